/* request.c: the request bodies of /v1/completions and /v1/chat/completions,
 * validated field by field.
 *
 * Policy on fields (docs/serve.md): every field is checked for its type and
 * range, and a wrong one is a 400 naming it. A field we do not know is a 400
 * too, as OpenAI answers: silently ignoring it could change what the client
 * gets without telling it. Known OpenAI fields that k3 does not implement are
 * accepted only at the value that means "off" (echo false, best_of 1, ...);
 * fields with no effect on the output (user, metadata, store, service_tier,
 * prompt_cache_key, safety_identifier) are accepted and ignored. The chat
 * template validates the messages and tools themselves (naming the field);
 * what it would accept but this text-only server cannot honour (an image
 * part) is refused here. */
#include "serve/serve.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *jtype(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static bool get_num(const json_t *v, double *out) {
    if (!json_is_number(v)) return false;
    *out = json_number_value(v);
    return isfinite(*out);
}

/* d as short as it reads back exactly: 2.0000001 must not print as "2" in a
 * message saying it is outside [0, 2] */
static const char *num_str(double d, char *buf, size_t n) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, d);
        if (strtod(buf, NULL) == d) break;
    }
    return buf;
}

static int out_of_range(k3_serve_error *e, const char *k, double d, double lo, double hi, bool lo_open) {
    char b[40];
    return k3_serve_error_set(e, 400, "invalid_value", k, "%s: %s is outside %s%g, %g]", k, num_str(d, b, sizeof b),
                              lo_open ? "(" : "[", lo, hi);
}

/* number in [lo, hi] */
static int want_num(k3_serve_error *e, const char *k, const json_t *v, double lo, double hi, bool lo_open, double *out) {
    if (!get_num(v, out))
        return k3_serve_error_set(e, 400, "invalid_type", k, "%s: expected a number, got %s", k, jtype(v));
    if (*out > hi || *out < lo || (lo_open && *out == lo)) return out_of_range(e, k, *out, lo, hi, lo_open);
    return 0;
}

static int want_int(k3_serve_error *e, const char *k, const json_t *v, json_int_t lo, json_int_t hi, json_int_t *out) {
    if (!json_is_integer(v)) {
        /* 5.0 is an integer to JSON's mind and to most clients' */
        double d;
        if (get_num(v, &d) && d == floor(d) && fabs(d) < 9.0e15) {
            *out = (json_int_t)d;
        } else {
            return k3_serve_error_set(e, 400, "invalid_type", k, "%s: expected an integer, got %s", k, jtype(v));
        }
    } else {
        *out = json_integer_value(v);
    }
    if (*out < lo || *out > hi) {
        if (hi == INT64_MAX / 4) /* no real upper bound: do not quote one */
            return k3_serve_error_set(e, 400, "invalid_value", k, "%s: %lld is not a count >= %lld", k, (long long)*out,
                                      (long long)lo);
        return k3_serve_error_set(e, 400, "invalid_value", k, "%s: %lld is outside [%lld, %lld]", k, (long long)*out, (long long)lo,
                   (long long)hi);
    }
    return 0;
}

static int want_bool(k3_serve_error *e, const char *k, const json_t *v, bool *out) {
    if (!json_is_boolean(v)) return k3_serve_error_set(e, 400, "invalid_type", k, "%s: expected a boolean, got %s", k, jtype(v));
    *out = json_is_true(v);
    return 0;
}

static int parse_stop(k3_serve_error *e, const json_t *v, k3_serve_req *r) {
    if (json_is_null(v)) return 0;
    const json_t *one = v;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > K3_SERVE_MAX_STOP)
            return k3_serve_error_set(e, 400, "invalid_value", "stop", "stop: at most %d stop strings, got %zu", K3_SERVE_MAX_STOP, n);
    } else if (!json_is_string(v)) {
        return k3_serve_error_set(e, 400, "invalid_type", "stop", "stop: expected a string or an array of strings, got %s", jtype(v));
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *s = json_is_array(v) ? json_array_get(v, i) : one;
        char where[32];
        snprintf(where, sizeof where, json_is_array(v) ? "stop[%zu]" : "stop", i);
        if (!json_is_string(s))
            return k3_serve_error_set(e, 400, "invalid_type", where, "%s: expected a string, got %s", where, jtype(s));
        size_t len = json_string_length(s);
        if (len == 0) return k3_serve_error_set(e, 400, "invalid_value", where, "%s: a stop string must not be empty", where);
        if (len > 256) return k3_serve_error_set(e, 400, "invalid_value", where, "%s: a stop string is at most 256 bytes", where);
        if (memchr(json_string_value(s), 0, len))
            return k3_serve_error_set(e, 400, "invalid_value", where, "%s: a stop string must not contain U+0000", where);
        r->stop[r->nstop++] = xstrdup(json_string_value(s));
    }
    return 0;
}

/* Fields accepted only at the value that leaves the output unchanged. */
static int only_off(k3_serve_error *e, const char *k, const json_t *v) {
    if (json_is_null(v)) return 0;
    bool off = false;
    double d;
    if (!strcmp(k, "echo")) off = json_is_false(v);
    else if (!strcmp(k, "best_of")) off = get_num(v, &d) && d == 1;
    else if (!strcmp(k, "suffix")) off = json_is_string(v) && json_string_length(v) == 0;
    if (off) return 0;
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    int rc = k3_serve_error_set(e, 400, "unsupported_value", k, "%s: %.60s is not supported by k3 serve (docs/serve.md)", k,
                 s ? s : "this value");
    free(s);
    return rc;
}

static bool is_one_of(const char *k, const char *const *list) {
    for (; *list; list++)
        if (!strcmp(k, *list)) return true;
    return false;
}

static const char *const IGNORED[] = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
                                      "safety_identifier", NULL};
static const char *const OFF_ONLY[] = {"echo", "best_of", "suffix", NULL};
static const char *const COMPLETION_ONLY[] = {"prompt", "echo", "best_of", "suffix", NULL};
static const char *const CHAT_ONLY[] = {"messages", "tools", "tool_choice", "response_format", "reasoning_effort",
                                        "chat_template_kwargs", "enable_thinking", "max_completion_tokens",
                                        "parallel_tool_calls", "top_logprobs", "modalities", NULL};

/* reasoning_effort, every value OpenAI documents (and the template's own
 * "max"), to the template's thinking_effort: NULL for none, where thinking
 * goes off; "" for medium, OpenAI's default, which renders no effort message
 * (the template's default: the release's encoder has no "medium"). */
static const struct {
    const char *openai, *effort;
} EFFORTS[] = {{"none", NULL}, {"minimal", "low"}, {"low", "low"}, {"medium", ""},
               {"high", "high"}, {"xhigh", "max"}, {"max", "max"}};

static int cmp_bias(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* logit_bias: {"token id": bias in [-100, 100]}; OpenAI's shape (ids as
 * decimal strings). Stored sorted by id, so equal requests apply equal sums. */
static int parse_bias(k3_serve_error *e, const json_t *v, k3_serve_req *r) {
    if (json_is_null(v)) return 0;
    if (!json_is_object(v))
        return k3_serve_error_set(e, 400, "invalid_type", "logit_bias", "logit_bias: expected an object, got %s", jtype(v));
    size_t n = json_object_size(v);
    if (n > K3_SERVE_MAX_BIAS)
        return k3_serve_error_set(e, 400, "invalid_value", "logit_bias", "logit_bias: at most %d entries, got %zu",
                                  K3_SERVE_MAX_BIAS, n);
    if (n == 0) return 0;
    /* id and bias packed in pairs to sort them together */
    int32_t *pairs = xmalloc_array(2 * n, sizeof *pairs);
    size_t i = 0;
    const char *k;
    json_t *x;
    json_object_foreach((json_t *)v, k, x) {
        char where[64];
        snprintf(where, sizeof where, "logit_bias.%.40s", k);
        char *end = NULL;
        long long id = strtoll(k, &end, 10);
        double b;
        int rc = 0;
        if (!*k || *end || k[0] == '-' || k[0] == '+' || k[0] == ' ' || id < 0 || id > INT32_MAX)
            rc = k3_serve_error_set(e, 400, "invalid_value", where, "%s: a key must be a token id (a decimal integer)", where);
        else
            rc = want_num(e, where, x, -100, 100, false, &b);
        if (rc) {
            free(pairs);
            return rc;
        }
        float f = (float)b;
        pairs[2 * i] = (int32_t)id;
        memcpy(&pairs[2 * i + 1], &f, sizeof f);
        i++;
    }
    qsort(pairs, n, 2 * sizeof *pairs, cmp_bias);
    r->bias_ids = xmalloc_array(n, sizeof *r->bias_ids);
    r->bias = xmalloc_array(n, sizeof *r->bias);
    for (i = 0; i < n; i++) {
        r->bias_ids[i] = pairs[2 * i];
        memcpy(&r->bias[i], &pairs[2 * i + 1], sizeof r->bias[i]);
    }
    r->nbias = n;
    free(pairs);
    return 0;
}

/* modalities: text is all this server produces */
static int parse_modalities(k3_serve_error *e, const json_t *v) {
    if (json_is_null(v)) return 0;
    if (!json_is_array(v) || json_array_size(v) == 0)
        return k3_serve_error_set(e, 400, json_is_array(v) ? "invalid_value" : "invalid_type", "modalities",
                                  "modalities: expected a non-empty array of strings, got %s", jtype(v));
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *m = json_array_get(v, i);
        if (!json_is_string(m))
            return k3_serve_error_set(e, 400, "invalid_type", "modalities", "modalities[%zu]: expected a string, got %s", i,
                                      jtype(m));
        if (strcmp(json_string_value(m), "text"))
            return k3_serve_error_set(e, 400, "unsupported_value", "modalities",
                                      "modalities: '%.40s' is not supported: this model produces text only",
                                      json_string_value(m));
    }
    return 0;
}

/* The messages as the template reads them: "developer" (OpenAI's newer name
 * for the system role) becomes "system"; a content part that is not text is
 * refused, since the template would render an image placeholder for a model
 * served without its vision tower. */
static int chat_messages(k3_serve_error *e, const json_t *msgs, json_t **out) {
    json_t *copy = json_deep_copy(msgs);
    if (!copy) return k3_serve_error_set(e, 500, "server_error", NULL, "out of memory copying the messages");
    for (size_t i = 0; i < json_array_size(copy); i++) {
        json_t *m = json_array_get(copy, i);
        if (!json_is_object(m)) continue; /* the template names it */
        const json_t *role = json_object_get(m, "role");
        if (json_is_string(role) && !strcmp(json_string_value(role), "developer"))
            json_object_set_new(m, "role", json_string("system"));
        const json_t *c = json_object_get(m, "content");
        for (size_t j = 0; json_is_array(c) && j < json_array_size(c); j++) {
            const json_t *part = json_array_get(c, j);
            const char *t = json_is_object(part) ? json_string_value(json_object_get(part, "type")) : NULL;
            if (t && strcmp(t, "text")) {
                char where[80];
                snprintf(where, sizeof where, "messages[%zu].content[%zu].type", i, j);
                /* t lives in copy: the message is written before copy goes */
                int rc = k3_serve_error_set(e, 400, "unsupported_value", where,
                                            "%s: '%.40s' parts are not supported: this model reads text only", where, t);
                json_decref(copy);
                return rc;
            }
        }
    }
    *out = copy;
    return 0;
}

static int parse_prompt(k3_serve_error *e, const json_t *v, k3_serve_req *r) {
    if (json_is_string(v)) {
        r->prompt_len = json_string_length(v);
        r->prompt = xmalloc(r->prompt_len + 1);
        memcpy(r->prompt, json_string_value(v), r->prompt_len + 1);
        return 0;
    }
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
        return parse_prompt(e, json_array_get(v, 0), r);
    if (json_is_array(v) && json_array_size(v) > 0 && json_is_number(json_array_get(v, 0))) {
        size_t n = json_array_size(v);
        r->prompt_ids = xmalloc_array(n, sizeof *r->prompt_ids);
        for (size_t i = 0; i < n; i++) {
            json_int_t id;
            char where[40];
            snprintf(where, sizeof where, "prompt[%zu]", i);
            int rc = want_int(e, where, json_array_get(v, i), 0, INT32_MAX, &id);
            if (rc) return rc;
            r->prompt_ids[i] = (int32_t)id;
        }
        r->nprompt_ids = n;
        return 0;
    }
    if (json_is_array(v) && (json_array_size(v) > 1 || json_is_array(json_array_get(v, 0))))
        return k3_serve_error_set(e, 400, "unsupported_value", "prompt",
                   "prompt: one prompt per request (a string or an array of token ids); batches are not supported");
    if (json_is_array(v) && json_array_size(v) > 0)
        return k3_serve_error_set(e, 400, "invalid_type", "prompt",
                   "prompt: expected a string or an array of token ids, got an array of %s", jtype(json_array_get(v, 0)));
    return k3_serve_error_set(e, 400, "invalid_type", "prompt", "prompt: expected a string or an array of token ids, got %s%s",
               jtype(v), json_is_array(v) ? " (empty)" : "");
}

/* The shapes OpenAI documents for tools, tool_choice and response_format;
 * the template reads them (and their contents) from there. */
static int check_tools(k3_serve_error *e, const json_t *tools, const json_t *choice, const json_t *rfmt) {
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools))
            return k3_serve_error_set(e, 400, "invalid_type", "tools", "tools: expected an array, got %s", jtype(tools));
        for (size_t i = 0; i < json_array_size(tools); i++) {
            const json_t *t = json_array_get(tools, i);
            char where[64];
            snprintf(where, sizeof where, "tools[%zu]", i);
            if (!json_is_object(t))
                return k3_serve_error_set(e, 400, "invalid_type", where, "%s: expected an object, got %s", where, jtype(t));
            const json_t *ty = json_object_get(t, "type"), *fn = json_object_get(t, "function");
            if (!json_is_string(ty) || strcmp(json_string_value(ty), "function"))
                return k3_serve_error_set(e, 400, "invalid_value", where, "%s.type: want \"function\"", where);
            if (!json_is_object(fn))
                return k3_serve_error_set(e, 400, "invalid_type", where, "%s.function: expected an object", where);
            const json_t *name = json_object_get(fn, "name"), *params = json_object_get(fn, "parameters"),
                         *desc = json_object_get(fn, "description");
            if (!json_is_string(name) || json_string_length(name) == 0)
                return k3_serve_error_set(e, 400, "invalid_value", where, "%s.function.name: expected a non-empty string", where);
            if (params && !json_is_null(params) && !json_is_object(params))
                return k3_serve_error_set(e, 400, "invalid_type", where, "%s.function.parameters: expected an object, got %s", where,
                           jtype(params));
            if (desc && !json_is_null(desc) && !json_is_string(desc))
                return k3_serve_error_set(e, 400, "invalid_type", where, "%s.function.description: expected a string, got %s",
                           where, jtype(desc));
            const json_t *strict = json_object_get(fn, "strict");
            if (strict && !json_is_null(strict) && !json_is_boolean(strict))
                return k3_serve_error_set(e, 400, "invalid_type", where, "%s.function.strict: expected a boolean, got %s",
                           where, jtype(strict));
        }
    }
    if (choice && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            const char *c = json_string_value(choice);
            if (strcmp(c, "auto") && strcmp(c, "none") && strcmp(c, "required"))
                return k3_serve_error_set(e, 400, "invalid_value", "tool_choice",
                           "tool_choice: want \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}} (got '%.60s')", c);
            if (!strcmp(c, "required") && json_array_size(tools) == 0)
                return k3_serve_error_set(e, 400, "invalid_value", "tool_choice",
                           "tool_choice: \"required\" needs at least one tool in tools");
        } else if (json_is_object(choice)) {
            const json_t *ty = json_object_get(choice, "type"), *fn = json_object_get(choice, "function");
            const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
            if (!json_is_string(ty) || strcmp(json_string_value(ty), "function") || !json_is_string(name))
                return k3_serve_error_set(e, 400, "invalid_value", "tool_choice",
                           "tool_choice: an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
            /* as OpenAI: the named function must be one of the request's tools */
            bool declared = false;
            for (size_t i = 0; json_is_array(tools) && i < json_array_size(tools) && !declared; i++) {
                const json_t *n = json_object_get(json_object_get(json_array_get(tools, i), "function"), "name");
                declared = json_is_string(n) && json_equal(n, name);
            }
            if (!declared)
                return k3_serve_error_set(e, 400, "invalid_value", "tool_choice",
                           "tool_choice: function '%.100s' is not among the request's tools", json_string_value(name));
        } else {
            return k3_serve_error_set(e, 400, "invalid_type", "tool_choice", "tool_choice: expected a string or an object, got %s",
                       jtype(choice));
        }
    }
    if (rfmt && !json_is_null(rfmt)) {
        if (!json_is_object(rfmt))
            return k3_serve_error_set(e, 400, "invalid_type", "response_format", "response_format: expected an object, got %s",
                       jtype(rfmt));
        const json_t *ty = json_object_get(rfmt, "type");
        const char *t = json_string_value(ty);
        if (!t || (strcmp(t, "text") && strcmp(t, "json_object") && strcmp(t, "json_schema")))
            return k3_serve_error_set(e, 400, "invalid_value", "response_format",
                       "response_format.type: want one of text, json_object, json_schema");
        if (!strcmp(t, "json_schema") && !json_is_object(json_object_get(rfmt, "json_schema")))
            return k3_serve_error_set(e, 400, "invalid_value", "response_format",
                       "response_format.json_schema: expected an object with the schema");
    }
    return 0;
}

/* response_format json_object / json_schema: the schema the reply is held
 * to (constrain.h), compiled here so that a keyword the machine cannot
 * enforce is a 400 naming it before the job is queued. The schema is where
 * the template finds it: json_schema.schema, else json_schema.json_schema. */
static int compile_format(k3_serve_error *e, const json_t *rfmt, k3_serve_req *r) {
    if (!rfmt || json_is_null(rfmt)) return 0;
    const char *t = json_string_value(json_object_get(rfmt, "type"));
    if (strcmp(t, "json_object") && strcmp(t, "json_schema")) return 0;
    const json_t *schema = NULL;
    const char *at = "response_format.json_schema.schema";
    if (!strcmp(t, "json_schema")) {
        const json_t *js = json_object_get(rfmt, "json_schema");
        schema = json_object_get(js, "schema");
        if (!schema && (schema = json_object_get(js, "json_schema"))) at = "response_format.json_schema.json_schema";
        if (!schema)
            return k3_serve_error_set(e, 400, "missing_required_parameter", "response_format",
                                      "response_format.json_schema.schema: required (the schema the reply must match)");
    }
    char where[512];
    k3_err err = {0};
    if (k3_jschema_compile(schema, &r->schema, where, sizeof where, &err))
        return k3_serve_error_set(e, 400, "unsupported_value", "response_format", "%s%s%.400s: %s", at, *where ? "." : "",
                                  where, err.msg);
    return 0;
}

/* The calls a reply makes (constrain.h): tool_choice "required" or
 * {"type": "function", "function": {"name"}}, or "auto" (also when absent)
 * with strict tools or parallel_tool_calls false; compiled here so that a
 * parameters keyword the mask cannot enforce is a 400 naming its path. An
 * enforced response_format keeps its place under "auto" (the reply is the
 * format's value, no call). */
static int compile_call(k3_serve_error *e, const json_t *tools, const json_t *choice, bool parallel, k3_serve_req *r) {
    const char *name = NULL;
    int how = K3_CALLS_AUTO;
    if (json_is_object(choice)) {
        name = json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        how = K3_CALLS_NAMED;
    } else if (json_is_string(choice) && !strcmp(json_string_value(choice), "required")) {
        how = K3_CALLS_REQUIRED;
    } else if ((json_is_string(choice) && !strcmp(json_string_value(choice), "none")) || r->schema) {
        return 0;
    }
    char where[512];
    k3_err err = {0};
    if (k3_callspec_compile(tools, how, name, parallel, &r->call, where, sizeof where, &err))
        return k3_serve_error_set(e, 400, "unsupported_value", "tools", "%.400s: %s", where, err.msg);
    return 0;
}

/* thinking as each spelling gave it (-1: not given); they must agree */
typedef struct {
    int v[3];
    const char *name[3];
} thinking_votes;

static int parse_kwargs(k3_serve_error *e, const json_t *v, thinking_votes *tv) {
    if (json_is_null(v)) return 0;
    if (!json_is_object(v))
        return k3_serve_error_set(e, 400, "invalid_type", "chat_template_kwargs", "chat_template_kwargs: expected an object, got %s",
                   jtype(v));
    const char *k;
    const json_t *x;
    json_object_foreach((json_t *)v, k, x) {
        char where[160];
        snprintf(where, sizeof where, "chat_template_kwargs.%.100s", k);
        if (!strcmp(k, "thinking") || !strcmp(k, "enable_thinking")) {
            bool b = false;
            int rc = want_bool(e, where, x, &b);
            if (rc) return rc;
            tv->v[k[0] == 't' ? 0 : 1] = b;
        } else {
            return k3_serve_error_set(e, 400, "unknown_parameter", where,
                       "%s: unknown template argument (known: thinking, enable_thinking)", where);
        }
    }
    return 0;
}

int k3_serve_parse(const char *body, size_t len, int kind, k3_serve_req *r, k3_serve_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->kind = kind;
    r->temperature = 1.0f; /* OpenAI's default */
    r->top_p = 1.0f;
    r->max_tokens = -1;
    r->thinking = true;
    r->n = 1;
    r->speculate = -1;
    r->repetition_penalty = 1.0f;
    json_error_t jerr;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!o)
        return k3_serve_error_set(e, 400, "invalid_json", NULL, "request body is not valid JSON: %s (line %d, column %d)", jerr.text,
                   jerr.line, jerr.column);
    int rc = 0;
    if (!json_is_object(o)) {
        rc = k3_serve_error_set(e, 400, "invalid_json", NULL, "request body: expected a JSON object, got %s", jtype(o));
        goto out;
    }
    bool parallel = true;
    json_t *msgs = NULL, *tools = NULL, *tool_choice = NULL, *rfmt = NULL, *effort = NULL, *stream_opts = NULL;
    bool have_prompt = false;
    json_int_t mt = -1, mct = -1;
    int top_lp = -1;
    thinking_votes tv = {{-1, -1, -1}, {"chat_template_kwargs.thinking", "chat_template_kwargs.enable_thinking",
                                        "enable_thinking"}};
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        if ((kind == K3_REQ_CHAT && is_one_of(k, COMPLETION_ONLY) && !is_one_of(k, CHAT_ONLY)) ||
            (kind == K3_REQ_COMPLETION && is_one_of(k, CHAT_ONLY) && !is_one_of(k, COMPLETION_ONLY))) {
            rc = k3_serve_error_set(e, 400, "unknown_parameter", k, "%s: not a field of %s (see docs/serve.md)", k,
                     kind == K3_REQ_CHAT ? "/v1/chat/completions" : "/v1/completions");
            goto out;
        }
        double d;
        json_int_t n;
        if (!strcmp(k, "model")) {
            if (!json_is_string(v)) { rc = k3_serve_error_set(e, 400, "invalid_type", k, "model: expected a string, got %s", jtype(v)); goto out; }
            r->model = xstrdup(json_string_value(v));
        } else if (!strcmp(k, "stream")) {
            if (!json_is_null(v) && (rc = want_bool(e, k, v, &r->stream))) goto out;
        } else if (!strcmp(k, "stream_options")) {
            stream_opts = v;
        } else if (!strcmp(k, "temperature")) {
            if (json_is_null(v)) continue;
            if ((rc = want_num(e, k, v, 0, 2, false, &d))) goto out;
            r->temperature = (float)d;
        } else if (!strcmp(k, "top_p")) {
            if (json_is_null(v)) continue;
            if ((rc = want_num(e, k, v, 0, 1, true, &d))) goto out;
            if (!k3_sample_top_p_ok(d, &r->top_p)) {
                rc = k3_serve_error_set(e, 400, "invalid_value", k, "top_p: %g rounds to 0 as the float the sampler "
                                        "uses (it would turn the filter off); the smallest is %g", d, 1.401298464324817e-45);
                goto out;
            }
        } else if (!strcmp(k, "min_p")) {
            if (json_is_null(v)) continue;
            if ((rc = want_num(e, k, v, 0, 1, false, &d))) goto out;
            r->min_p = (float)d;
        } else if (!strcmp(k, "top_k")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, -1, INT32_MAX, &n))) goto out;
            r->top_k = n < 0 ? 0 : (int)n; /* -1: off, as vLLM spells it */
        } else if (!strcmp(k, "seed")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, INT64_MIN, INT64_MAX, &n))) goto out;
            r->seed = (uint64_t)n;
        } else if (!strcmp(k, "max_tokens")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, 1, INT64_MAX / 4, &mt))) goto out;
        } else if (!strcmp(k, "max_completion_tokens")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, 1, INT64_MAX / 4, &mct))) goto out;
        } else if (!strcmp(k, "stop")) {
            if ((rc = parse_stop(e, v, r))) goto out;
        } else if (!strcmp(k, "n")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, 1, K3_SERVE_MAX_N, &n))) goto out;
            r->n = (int)n;
        } else if (!strcmp(k, "speculate")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, 0, K3_SPEC_MAX, &n))) goto out;
            r->speculate = (int)n;
        } else if (!strcmp(k, "logprobs")) {
            if (json_is_null(v)) continue;
            if (kind == K3_REQ_CHAT) {
                if ((rc = want_bool(e, k, v, &r->logprobs))) goto out;
            } else {
                /* the legacy endpoint's logprobs is the number of alternatives */
                if ((rc = want_int(e, k, v, 0, K3_SERVE_MAX_LOGPROBS, &n))) goto out;
                r->logprobs = true;
                r->top_logprobs = (int)n;
            }
        } else if (!strcmp(k, "top_logprobs")) {
            if (json_is_null(v)) continue;
            if ((rc = want_int(e, k, v, 0, K3_SERVE_MAX_LOGPROBS, &n))) goto out;
            top_lp = (int)n;
        } else if (!strcmp(k, "presence_penalty") || !strcmp(k, "frequency_penalty")) {
            if (json_is_null(v)) continue;
            if ((rc = want_num(e, k, v, -2, 2, false, &d))) goto out;
            *(k[0] == 'p' ? &r->presence_penalty : &r->frequency_penalty) = (float)d;
        } else if (!strcmp(k, "repetition_penalty")) {
            if (json_is_null(v)) continue;
            if ((rc = want_num(e, k, v, 0, 10, true, &d))) goto out;
            r->repetition_penalty = (float)d;
        } else if (!strcmp(k, "logit_bias")) {
            if ((rc = parse_bias(e, v, r))) goto out;
        } else if (!strcmp(k, "modalities")) {
            if ((rc = parse_modalities(e, v))) goto out;
        } else if (!strcmp(k, "prompt")) {
            have_prompt = true;
            if ((rc = parse_prompt(e, v, r))) goto out;
        } else if (!strcmp(k, "messages")) {
            msgs = v;
        } else if (!strcmp(k, "tools")) {
            tools = v;
        } else if (!strcmp(k, "tool_choice")) {
            tool_choice = v;
        } else if (!strcmp(k, "parallel_tool_calls")) {
            if (!json_is_null(v) && (rc = want_bool(e, k, v, &parallel))) goto out;
        } else if (!strcmp(k, "response_format")) {
            rfmt = v;
        } else if (!strcmp(k, "reasoning_effort")) {
            effort = v;
        } else if (!strcmp(k, "chat_template_kwargs")) {
            if ((rc = parse_kwargs(e, v, &tv))) goto out;
        } else if (!strcmp(k, "enable_thinking")) {
            bool b = false;
            if (!json_is_null(v) && (rc = want_bool(e, k, v, &b))) goto out;
            if (!json_is_null(v)) tv.v[2] = b;
        } else if (is_one_of(k, OFF_ONLY)) {
            if ((rc = only_off(e, k, v))) goto out;
        } else if (is_one_of(k, IGNORED)) {
            /* no effect on the output */
        } else {
            rc = k3_serve_error_set(e, 400, "unknown_parameter", k, "%.100s: unrecognized request field (see docs/serve.md)", k);
            goto out;
        }
    }
    for (int a = 0; a < 3; a++)
        for (int b = a + 1; b < 3; b++)
            if (tv.v[a] >= 0 && tv.v[b] >= 0 && tv.v[a] != tv.v[b]) {
                rc = k3_serve_error_set(e, 400, "invalid_value", tv.name[b], "%s (%s) contradicts %s (%s): give one",
                                        tv.name[b], tv.v[b] ? "true" : "false", tv.name[a], tv.v[a] ? "true" : "false");
                goto out;
            }
    for (int a = 0; a < 3; a++)
        if (tv.v[a] >= 0) r->thinking = tv.v[a];
    if (mt >= 0 && mct >= 0 && mt != mct) {
        rc = k3_serve_error_set(e, 400, "invalid_value", "max_completion_tokens",
                 "max_tokens (%lld) and max_completion_tokens (%lld) disagree: give one", (long long)mt, (long long)mct);
        goto out;
    }
    r->max_tokens = mct >= 0 ? mct : mt;
    if (top_lp > 0 && !r->logprobs) {
        rc = k3_serve_error_set(e, 400, "invalid_value", "top_logprobs", "top_logprobs: needs logprobs: true");
        goto out;
    }
    if (top_lp >= 0) r->top_logprobs = top_lp;
    if (stream_opts && !json_is_null(stream_opts)) {
        if (!r->stream) {
            rc = k3_serve_error_set(e, 400, "invalid_value", "stream_options", "stream_options: only allowed when stream is true");
            goto out;
        }
        if (!json_is_object(stream_opts)) {
            rc = k3_serve_error_set(e, 400, "invalid_type", "stream_options", "stream_options: expected an object, got %s",
                     jtype(stream_opts));
            goto out;
        }
        json_object_foreach(stream_opts, k, v) {
            char where[160];
            snprintf(where, sizeof where, "stream_options.%.100s", k);
            if (!strcmp(k, "include_usage")) {
                if ((rc = want_bool(e, where, v, &r->include_usage))) goto out;
            } else if (!strcmp(k, "continuous_usage_stats") && json_is_false(v)) {
            } else {
                rc = k3_serve_error_set(e, 400, "unknown_parameter", where, "%s: unknown stream option (known: include_usage)", where);
                goto out;
            }
        }
    }
    if (kind == K3_REQ_COMPLETION) {
        if (!have_prompt) { rc = k3_serve_error_set(e, 400, "missing_required_parameter", "prompt", "prompt: required"); goto out; }
        goto out;
    }
    /* chat: the template's request */
    if (!msgs) { rc = k3_serve_error_set(e, 400, "missing_required_parameter", "messages", "messages: required"); goto out; }
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        rc = k3_serve_error_set(e, 400, json_is_array(msgs) ? "invalid_value" : "invalid_type", "messages",
                 "messages: expected a non-empty array, got %s%s", jtype(msgs), json_is_array(msgs) ? " (empty)" : "");
        goto out;
    }
    if ((rc = check_tools(e, tools, tool_choice, rfmt))) goto out;
    if ((rc = compile_format(e, rfmt, r))) goto out;
    if ((rc = compile_call(e, tools, tool_choice, parallel, r))) goto out;
    const char *effort_as = "";
    if (effort && !json_is_null(effort)) {
        if (!json_is_string(effort)) {
            rc = k3_serve_error_set(e, 400, "invalid_type", "reasoning_effort", "reasoning_effort: expected a string, got %s",
                                    jtype(effort));
            goto out;
        }
        size_t i = 0, ne = sizeof EFFORTS / sizeof EFFORTS[0];
        while (i < ne && strcmp(json_string_value(effort), EFFORTS[i].openai)) i++;
        if (i == ne) {
            rc = k3_serve_error_set(e, 400, "invalid_value", "reasoning_effort",
                                    "reasoning_effort: want one of none, minimal, low, medium, high, xhigh, max (got '%.40s')",
                                    json_string_value(effort));
            goto out;
        }
        effort_as = EFFORTS[i].effort;
        if (!effort_as) r->thinking = false;
    }
    json_t *copy = NULL;
    if ((rc = chat_messages(e, msgs, &copy))) goto out;
    r->chat = json_object();
    json_object_set_new(r->chat, "messages", copy);
    if (tools && !json_is_null(tools)) json_object_set(r->chat, "tools", tools);
    if (tool_choice && !json_is_null(tool_choice)) json_object_set(r->chat, "tool_choice", tool_choice);
    if (rfmt && !json_is_null(rfmt)) json_object_set(r->chat, "response_format", rfmt);
    if (effort_as && *effort_as) json_object_set_new(r->chat, "thinking_effort", json_string(effort_as));
    json_object_set_new(r->chat, "thinking", json_boolean(r->thinking));
out:
    json_decref(o);
    if (rc) k3_serve_req_free(r);
    return rc;
}

void k3_serve_req_free(k3_serve_req *r) {
    free(r->model);
    for (size_t i = 0; i < r->nstop; i++) free(r->stop[i]);
    free(r->prompt);
    free(r->prompt_ids);
    free(r->bias_ids);
    free(r->bias);
    json_decref(r->chat);
    k3_jschema_free(r->schema);
    k3_callspec_free(r->call);
    int kind = r->kind;
    memset(r, 0, sizeof *r);
    r->kind = kind;
}

/* ---- stop strings ---- */

void k3_stopper_init(k3_stopper *s, char *const *stop, size_t nstop) {
    memset(s, 0, sizeof *s);
    s->stop = stop;
    s->nstop = nstop;
}

static void held_reserve(k3_stopper *s, size_t n) {
    if (n <= s->cap) return;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    /* two halves: the held text, and the text released by the last call */
    s->held = xrealloc(s->held, 2 * cap);
    s->cap = cap;
}

void k3_stopper_feed(k3_stopper *s, const char *text, size_t n, const char **out, size_t *nout) {
    *out = "";
    *nout = 0;
    if (s->hit || n == 0) return;
    held_reserve(s, s->nheld + n);
    memcpy(s->held + s->nheld, text, n);
    s->nheld += n;
    char *rel = s->held + s->cap;
    /* the earliest stop string wins */
    size_t cut = s->nheld;
    for (size_t i = 0; i < s->nstop; i++) {
        const char *p = memmem(s->held, s->nheld, s->stop[i], strlen(s->stop[i]));
        if (p && (size_t)(p - s->held) < cut) cut = (size_t)(p - s->held);
    }
    if (cut < s->nheld) {
        s->hit = true;
        memcpy(rel, s->held, cut);
        s->nheld = 0;
        *out = rel;
        *nout = cut;
        return;
    }
    /* keep the longest suffix that begins some stop string */
    size_t keep = 0;
    for (size_t i = 0; i < s->nstop; i++) {
        size_t L = strlen(s->stop[i]);
        for (size_t k = L - 1 < s->nheld ? L - 1 : s->nheld; k > keep; k--)
            if (!memcmp(s->held + s->nheld - k, s->stop[i], k)) { keep = k; break; }
    }
    size_t r = s->nheld - keep;
    memcpy(rel, s->held, r);
    memmove(s->held, s->held + r, keep);
    s->nheld = keep;
    *out = rel;
    *nout = r;
}

void k3_stopper_flush(k3_stopper *s, const char **out, size_t *nout) {
    *out = s->held ? s->held : "";
    *nout = s->hit ? 0 : s->nheld;
    s->nheld = 0;
}

void k3_stopper_free(k3_stopper *s) {
    free(s->held);
    memset(s, 0, sizeof *s);
}
