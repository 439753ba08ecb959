/* test_serve.c: k3 serve's request validation and its stop-string filter.
 * (The HTTP side is tested against the real binary in tests/cli/test_serve*.sh.) */
#include "harness.h"
#include "model/model.h"
#include "serve/serve.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse(const char *body, int kind, k3_serve_req *r, k3_serve_error *e) {
    return k3_serve_parse(body, strlen(body), kind, r, e);
}

TEST(serve_parse_defaults) {
    k3_serve_req r;
    k3_serve_error e;
    CHECK(parse("{\"prompt\":\"hi\"}", K3_REQ_COMPLETION, &r, &e) == 0);
    /* OpenAI's defaults: temperature 1, top_p 1, no max_tokens, not streamed */
    CHECK(r.temperature == 1.0f && r.top_p == 1.0f && r.top_k == 0 && r.min_p == 0.0f);
    CHECK(r.max_tokens == -1 && !r.stream && !r.include_usage && r.nstop == 0);
    CHECK(r.prompt && !strcmp(r.prompt, "hi") && r.prompt_len == 2 && !r.prompt_ids);
    k3_serve_req_free(&r);
}

TEST(serve_parse_fields) {
    k3_serve_req r;
    k3_serve_error e;
    const char *b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":0.5,"
                    "\"top_p\":0.9,\"top_k\":-1,\"min_p\":0.1,\"seed\":-3,\"max_completion_tokens\":7,"
                    "\"stop\":\"END\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                    "\"tools\":[],\"reasoning_effort\":\"high\",\"chat_template_kwargs\":{\"thinking\":false},"
                    "\"n\":1,\"user\":\"u\"}";
    CHECKF(parse(b, K3_REQ_CHAT, &r, &e) == 0, "%s", e.message);
    CHECK(r.temperature == 0.5f && r.top_p == 0.9f && r.top_k == 0 && r.min_p == 0.1f);
    CHECK(r.seed == (uint64_t)-3 && r.max_tokens == 7 && r.stream && r.include_usage);
    CHECK(r.nstop == 1 && !strcmp(r.stop[0], "END") && !strcmp(r.model, "m"));
    CHECK(!r.thinking);
    /* the template's request: messages, tools, thinking, thinking_effort */
    CHECK(json_is_array(json_object_get(r.chat, "messages")));
    CHECK(json_is_false(json_object_get(r.chat, "thinking")));
    CHECK(!strcmp(json_string_value(json_object_get(r.chat, "thinking_effort")), "high"));
    CHECK(json_object_get(r.chat, "tools") != NULL);
    k3_serve_req_free(&r);
    /* the shapes OpenAI documents pass */
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
        "{\"name\":\"f\",\"description\":\"d\",\"parameters\":{\"type\":\"object\"},\"strict\":true}}],"
        "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
        "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"s\",\"schema\":{}}}}";
    CHECKF(parse(b, K3_REQ_CHAT, &r, &e) == 0, "%s", e.message);
    CHECK(json_object_get(r.chat, "tool_choice") && json_object_get(r.chat, "response_format"));
    CHECK(json_object_get(r.chat, "model") == NULL && json_object_get(r.chat, "temperature") == NULL);
    CHECK(r.call != NULL); /* a named function is enforced */
    k3_serve_req_free(&r);
    /* auto (or no tool_choice) enforces nothing, and does not compile the tools */
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
        "{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"minimum\":0}}}}}],"
        "\"tool_choice\":\"auto\"}";
    CHECKF(parse(b, K3_REQ_CHAT, &r, &e) == 0, "%s", e.message);
    CHECK(r.call == NULL && r.schema == NULL);
    k3_serve_req_free(&r);
    /* enable_thinking is the other spelling */
    CHECK(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"enable_thinking\":false}}",
                K3_REQ_CHAT, &r, &e) == 0);
    CHECK(!r.thinking);
    k3_serve_req_free(&r);
    CHECK(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", K3_REQ_CHAT, &r, &e) == 0);
    CHECK(r.thinking && json_is_true(json_object_get(r.chat, "thinking")));
    k3_serve_req_free(&r);
    /* a token-id prompt */
    CHECK(parse("{\"prompt\":[5,6,7]}", K3_REQ_COMPLETION, &r, &e) == 0);
    CHECK(r.nprompt_ids == 3 && r.prompt_ids[2] == 7 && !r.prompt);
    k3_serve_req_free(&r);
}

/* the fields OpenAI's clients send: developer, every reasoning_effort, modalities,
 * n, logprobs, penalties, logit_bias */
TEST(serve_parse_client_fields) {
    k3_serve_req r;
    k3_serve_error e;
    const char *b = "{\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},{\"role\":\"user\","
                    "\"content\":[{\"type\":\"text\",\"text\":\"x\"}]}],\"modalities\":[\"text\"],\"n\":3,"
                    "\"logprobs\":true,\"top_logprobs\":4,\"presence_penalty\":0.5,\"frequency_penalty\":-0.25,"
                    "\"repetition_penalty\":1.2,\"logit_bias\":{\"30\":-100,\"7\":2.5},\"prompt_cache_key\":\"k\"}";
    CHECKF(parse(b, K3_REQ_CHAT, &r, &e) == 0, "%s", e.message);
    const json_t *m0 = json_array_get(json_object_get(r.chat, "messages"), 0);
    CHECK(!strcmp(json_string_value(json_object_get(m0, "role")), "system"));
    CHECK(r.n == 3 && r.logprobs && r.top_logprobs == 4);
    CHECK(r.presence_penalty == 0.5f && r.frequency_penalty == -0.25f && r.repetition_penalty == 1.2f);
    /* sorted by id */
    CHECK(r.nbias == 2 && r.bias_ids[0] == 7 && r.bias[0] == 2.5f && r.bias_ids[1] == 30 && r.bias[1] == -100.0f);
    k3_serve_req_free(&r);
    /* defaults: one choice, nothing processed */
    CHECK(parse("{\"prompt\":\"a\"}", K3_REQ_COMPLETION, &r, &e) == 0);
    CHECK(r.n == 1 && !r.logprobs && r.repetition_penalty == 1.0f && r.presence_penalty == 0 && r.nbias == 0);
    CHECK(r.speculate == -1); /* the server's default */
    k3_serve_req_free(&r);
    /* k3's speculate: drafts per pass, both endpoints (the server checks its own bound) */
    CHECK(parse("{\"prompt\":\"a\",\"speculate\":16}", K3_REQ_COMPLETION, &r, &e) == 0 && r.speculate == 16);
    k3_serve_req_free(&r);
    CHECK(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"speculate\":0}", K3_REQ_CHAT, &r, &e) == 0 &&
          r.speculate == 0);
    k3_serve_req_free(&r);
    /* the legacy endpoint's logprobs is a count */
    CHECK(parse("{\"prompt\":\"a\",\"logprobs\":3}", K3_REQ_COMPLETION, &r, &e) == 0);
    CHECK(r.logprobs && r.top_logprobs == 3);
    k3_serve_req_free(&r);
    /* every documented effort: thinking off, or the template's effort (medium: none rendered) */
    static const struct { const char *openai, *effort; bool thinking; } eff[] = {
        {"none", NULL, false}, {"minimal", "low", true}, {"low", "low", true}, {"medium", NULL, true},
        {"high", "high", true}, {"xhigh", "max", true}, {"max", "max", true}};
    for (size_t i = 0; i < sizeof eff / sizeof eff[0]; i++) {
        char body[160];
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"reasoning_effort\":\"%s\"}",
                 eff[i].openai);
        CHECKF(parse(body, K3_REQ_CHAT, &r, &e) == 0, "%s: %s", eff[i].openai, e.message);
        const json_t *te = json_object_get(r.chat, "thinking_effort");
        CHECKF(eff[i].effort ? te && !strcmp(json_string_value(te), eff[i].effort) : te == NULL, "%s", eff[i].openai);
        CHECKF(r.thinking == eff[i].thinking && json_is_boolean(json_object_get(r.chat, "thinking")) &&
                   json_is_true(json_object_get(r.chat, "thinking")) == eff[i].thinking, "%s", eff[i].openai);
        k3_serve_req_free(&r);
    }
}

/* penalties and bias change exactly the ids they name, as documented; off,
 * the logits are handed through untouched */
TEST(serve_logit_processing) {
    enum { V = 8 };
    const float base[V] = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f, 1.0f, 4.0f};
    k3_serve_req r;
    k3_serve_error e;
    CHECK(parse("{\"prompt\":\"a\"}", K3_REQ_COMPLETION, &r, &e) == 0);
    k3_logit_proc p;
    const int32_t prompt[] = {0, 1, 1};
    k3_logit_proc_init(&p, &r, V, prompt, 3);
    CHECK(k3_logit_proc_apply(&p, base) == base);
    k3_logit_proc_free(&p);
    k3_serve_req_free(&r);
    CHECK(parse("{\"prompt\":\"a\",\"repetition_penalty\":2,\"presence_penalty\":0.5,\"frequency_penalty\":0.25,"
                "\"logit_bias\":{\"7\":-100,\"4\":1}}", K3_REQ_COMPLETION, &r, &e) == 0);
    k3_logit_proc_init(&p, &r, V, prompt, 3);
    k3_logit_proc_accept(&p, 3);
    k3_logit_proc_accept(&p, 3);
    k3_logit_proc_accept(&p, 1);
    const float *w = k3_logit_proc_apply(&p, base);
    /* 0: prompt only, positive: /2; 1: prompt and reply once, negative: *2 - 0.25 - 0.5;
     * 3: reply twice: /2 - 0.5 - 0.5; 4: bias +1; 7: bias -100; the rest untouched */
    const float want[V] = {1.0f, -2.75f, 0.5f, 0.5f, -1.0f, 0.0f, 1.0f, -96.0f};
    for (int i = 0; i < V; i++) CHECKF(w[i] == want[i], "id %d: %g, want %g", i, w[i], want[i]);
    k3_logit_proc_free(&p);
    k3_serve_req_free(&r);
    /* log-softmax and the top ids (ties: lower id first) */
    const float l[5] = {1.0f, 3.0f, 3.0f, -1.0f, 2.0f};
    k3_logprob top[3];
    float x = k3_logprobs(l, 5, 4, 3, top);
    double lse = log(exp(1.0) + 2 * exp(3.0) + exp(-1.0) + exp(2.0));
    CHECKF(fabs(x - (2.0 - lse)) < 1e-6, "%g", x);
    CHECK(top[0].id == 1 && top[1].id == 2 && top[2].id == 4);
    CHECK(fabs(top[0].logprob - (3.0 - lse)) < 1e-6 && top[0].logprob == top[1].logprob);
}

/* every refusal: status, code and the parameter it names */
TEST(serve_parse_errors) {
    static const struct {
        int kind;
        const char *body, *code, *param;
    } cases[] = {
        {K3_REQ_COMPLETION, "{\"prompt\":", "invalid_json", ""},
        {K3_REQ_COMPLETION, "\"text\"", "invalid_json", ""},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"prompt\":\"b\"}", "invalid_json", ""},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", "invalid_type", "temperature"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"temperature\":2.5}", "invalid_value", "temperature"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"top_p\":0}", "invalid_value", "top_p"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"min_p\":-0.1}", "invalid_value", "min_p"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"top_k\":1.5}", "invalid_type", "top_k"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":0}", "invalid_value", "max_tokens"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":\"5\"}", "invalid_type", "max_tokens"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"max_tokens\":5,\"max_completion_tokens\":6}", "invalid_value",
         "max_completion_tokens"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"stop\":\"\"}", "invalid_value", "stop"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"stop\":[\"x\",\"\"]}", "invalid_value", "stop[1]"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"stop\":5}", "invalid_type", "stop"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"n\":9}", "invalid_value", "n"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"n\":0}", "invalid_value", "n"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":21}", "invalid_value", "logprobs"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":true}", "invalid_type", "logprobs"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"logprobs\":2}", "invalid_type", "logprobs"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"top_logprobs\":2}", "invalid_value", "top_logprobs"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"logprobs\":true,\"top_logprobs\":21}", "invalid_value", "top_logprobs"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"echo\":true}", "unsupported_value", "echo"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"frequency_penalty\":2.5}", "invalid_value", "frequency_penalty"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"presence_penalty\":\"x\"}", "invalid_type", "presence_penalty"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"repetition_penalty\":0}", "invalid_value", "repetition_penalty"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"speculate\":17}", "invalid_value", "speculate"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"speculate\":-1}", "invalid_value", "speculate"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"speculate\":\"4\"}", "invalid_type", "speculate"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"5\":101}}", "invalid_value", "logit_bias.5"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"x\":1}}", "invalid_value", "logit_bias.x"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"-1\":1}}", "invalid_value", "logit_bias.-1"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":[1]}", "invalid_type", "logit_bias"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"modalities\":[\"text\"]}", "unknown_parameter", "modalities"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"modalities\":[\"text\",\"audio\"]}", "unsupported_value", "modalities"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"modalities\":\"text\"}", "invalid_type", "modalities"},
        {K3_REQ_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                      "{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x/y.png\"}}]}]}",
         "unsupported_value", "messages[0].content[1].type"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"reasoning_effort\":\"turbo\"}", "invalid_value", "reasoning_effort"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"wat\":1}", "unknown_parameter", "wat"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"tools\":[]}", "unknown_parameter", "tools"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"prompt\":\"a\"}", "unknown_parameter", "prompt"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"parallel_tool_calls\":\"no\"}", "invalid_type", "parallel_tool_calls"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"parallel_tool_calls\":false}", "unknown_parameter", "parallel_tool_calls"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"strict\":1}}]}",
         "invalid_type", "tools[0]"},
        /* a strict tool under auto is enforced, so its schema is compiled */
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"strict\":true,"
         "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"minimum\":0}}}}}]}", "unsupported_value", "tools"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", "invalid_value",
         "stream_options"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":{\"x\":1}}", "unknown_parameter",
         "stream_options.x"},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"model\":5}", "invalid_type", "model"},
        {K3_REQ_COMPLETION, "{}", "missing_required_parameter", "prompt"},
        {K3_REQ_COMPLETION, "{\"prompt\":[]}", "invalid_type", "prompt"},
        {K3_REQ_COMPLETION, "{\"prompt\":[1,-2]}", "invalid_value", "prompt[1]"},
        {K3_REQ_COMPLETION, "{\"prompt\":[\"a\",\"b\"]}", "unsupported_value", "prompt"},
        {K3_REQ_CHAT, "{}", "missing_required_parameter", "messages"},
        {K3_REQ_CHAT, "{\"messages\":[]}", "invalid_value", "messages"},
        {K3_REQ_CHAT, "{\"messages\":{}}", "invalid_type", "messages"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"reasoning_effort\":3}", "invalid_type", "reasoning_effort"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"chat_template_kwargs\":{\"thinking\":1}}", "invalid_type",
         "chat_template_kwargs.thinking"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"chat_template_kwargs\":{\"foo\":true}}", "unknown_parameter",
         "chat_template_kwargs.foo"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"enable_thinking\":\"no\"}", "invalid_type", "enable_thinking"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":{}}", "invalid_type", "tools"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\"}]}", "invalid_type", "tools[0]"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"code\",\"function\":{\"name\":\"f\"}}]}",
         "invalid_value", "tools[0]"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]}",
         "invalid_value", "tools[0]"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]}",
         "invalid_type", "tools[0]"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tool_choice\":\"banana\"}", "invalid_value", "tool_choice"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tool_choice\":{\"type\":\"function\"}}", "invalid_value", "tool_choice"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tool_choice\":3}", "invalid_type", "tool_choice"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
         "{\"type\":\"object\",\"properties\":{\"a\":{\"minimum\":0}}}}}],\"tool_choice\":\"required\"}",
         "unsupported_value", "tools"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"response_format\":{\"type\":\"yaml\"}}", "invalid_value", "response_format"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"response_format\":{\"type\":\"json_schema\"}}", "invalid_value",
         "response_format"},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"response_format\":\"json\"}", "invalid_type", "response_format"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_serve_req r;
        k3_serve_error e;
        int st = parse(cases[i].body, cases[i].kind, &r, &e);
        CHECKF(st == 400, "case %zu (%s): status %d", i, cases[i].body, st);
        CHECKF(e.status == 400 && !strcmp(e.type, "invalid_request_error"), "case %zu", i);
        CHECKF(e.code && !strcmp(e.code, cases[i].code), "case %zu (%s): code %s", i, cases[i].body, e.code);
        CHECKF(!strcmp(e.param, cases[i].param), "case %zu (%s): param '%s'", i, cases[i].body, e.param);
        CHECKF(strlen(e.message) > 0, "case %zu", i);
        /* nothing is left allocated after a refusal */
        CHECK(!r.prompt && !r.prompt_ids && !r.chat && r.nstop == 0 && !r.model);
    }
}

/* refusals found by trying to break the server: each says what is wrong */
TEST(serve_parse_hostile) {
    static const struct {
        int kind;
        const char *body, *code, *param, *says, *not_says;
    } cases[] = {
        /* rounds to 0.0f: it would turn the filter off, as k3 run refuses it */
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"top_p\":1e-46}", "invalid_value", "top_p", "rounds to 0", NULL},
        /* just past a bound is not printed as the bound */
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"temperature\":2.0000001}", "invalid_value", "temperature",
         "2.0000001 is outside [0, 2]", NULL},
        {K3_REQ_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":0}", "invalid_value", "max_tokens", "count >= 1",
         "2305843009213693951"},
        /* a batch of id prompts is no "empty array" */
        {K3_REQ_COMPLETION, "{\"prompt\":[[1,2]]}", "unsupported_value", "prompt", "batches", "empty"},
        {K3_REQ_COMPLETION, "{\"prompt\":[true]}", "invalid_type", "prompt", "an array of a boolean", "empty"},
        /* a named tool that the request does not declare, as OpenAI */
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}",
         "invalid_value", "tool_choice", "'g' is not among", NULL},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
         "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}", "invalid_value", "tool_choice",
         "'g' is not among", NULL},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"tool_choice\":\"required\"}", "invalid_value", "tool_choice", "at least one",
         NULL},
        /* thinking asked on and off at once */
        {K3_REQ_CHAT, "{\"messages\":[{}],\"chat_template_kwargs\":{\"thinking\":true},\"enable_thinking\":false}",
         "invalid_value", "enable_thinking", "contradicts", NULL},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"enable_thinking\":false,\"chat_template_kwargs\":{\"thinking\":true}}",
         "invalid_value", "enable_thinking", "contradicts", NULL},
        {K3_REQ_CHAT, "{\"messages\":[{}],\"chat_template_kwargs\":{\"thinking\":true,\"enable_thinking\":false}}",
         "invalid_value", "chat_template_kwargs.enable_thinking", "contradicts", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_serve_req r;
        k3_serve_error e;
        int st = parse(cases[i].body, cases[i].kind, &r, &e);
        CHECKF(st == 400 && e.code && !strcmp(e.code, cases[i].code) && !strcmp(e.param, cases[i].param),
               "case %zu (%s): %d %s '%s': %s", i, cases[i].body, st, e.code, e.param, e.message);
        CHECKF(strstr(e.message, cases[i].says), "case %zu: '%s' lacks '%s'", i, e.message, cases[i].says);
        CHECKF(!cases[i].not_says || !strstr(e.message, cases[i].not_says), "case %zu: '%s'", i, e.message);
        if (!st) k3_serve_req_free(&r);
    }
    /* agreeing spellings pass; a declared named tool passes */
    k3_serve_req r;
    k3_serve_error e;
    CHECKF(parse("{\"messages\":[{}],\"enable_thinking\":false,\"chat_template_kwargs\":{\"thinking\":false}}",
                 K3_REQ_CHAT, &r, &e) == 0, "%s", e.message);
    CHECK(!r.thinking);
    k3_serve_req_free(&r);
    CHECKF(parse("{\"messages\":[{}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                 "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}}", K3_REQ_CHAT, &r, &e) == 0,
           "%s", e.message);
    k3_serve_req_free(&r);
    CHECKF(parse("{\"prompt\":\"a\",\"top_p\":1.5e-45}", K3_REQ_COMPLETION, &r, &e) == 0, "%s", e.message);
    CHECK(r.top_p > 0.0f);
    k3_serve_req_free(&r);
    /* the one check `k3 run --top-p` and serve share, on the float */
    float f = 0;
    CHECK(!k3_sample_top_p_ok(1e-46, &f) && !k3_sample_top_p_ok(0, &f) && !k3_sample_top_p_ok(-1, &f));
    CHECK(!k3_sample_top_p_ok(1.0000001, &f) && !k3_sample_top_p_ok(0.0 / 0.0, &f));
    CHECK(k3_sample_top_p_ok(1, &f) && f == 1.0f && k3_sample_top_p_ok(0.5, &f) && f == 0.5f);
}

/* Which calls a request enforces: tool_choice, strict tools and
 * parallel_tool_calls (OpenAI: "required" one or more calls, a named
 * function exactly one, parallel_tool_calls false at most one). */
TEST(serve_parse_enforced_calls) {
#define STRICT_F "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"strict\":true,\"parameters\":" \
                 "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}}}}}"
#define LOOSE_G "{\"type\":\"function\",\"function\":{\"name\":\"g\",\"parameters\":{\"type\":\"object\"," \
                "\"properties\":{\"a\":{\"minimum\":0}}}}}"
    static const struct {
        const char *rest; /* after "messages" */
        int how;          /* -1: nothing enforced */
        bool multi, schema;
        size_t ntools;    /* tools a call's name is chosen among */
    } C[] = {
        {"\"tools\":[" STRICT_F "],\"tool_choice\":\"required\"", K3_CALLS_REQUIRED, true, false, 1},
        {"\"tools\":[" STRICT_F "],\"tool_choice\":\"required\",\"parallel_tool_calls\":null", K3_CALLS_REQUIRED, true, false, 1},
        {"\"tools\":[" STRICT_F "],\"tool_choice\":\"required\",\"parallel_tool_calls\":false", K3_CALLS_REQUIRED, false,
         false, 1},
        {"\"tools\":[" STRICT_F "],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
         "\"parallel_tool_calls\":true", K3_CALLS_NAMED, false, false, 1},
        {"\"tools\":[" STRICT_F "," LOOSE_G "],\"tool_choice\":\"auto\"", K3_CALLS_AUTO, true, false, 2},
        {"\"tools\":[" LOOSE_G "," STRICT_F "]", K3_CALLS_AUTO, true, false, 2},
        {"\"tools\":[" STRICT_F "],\"parallel_tool_calls\":false", K3_CALLS_AUTO, false, false, 1},
        {"\"tools\":[" LOOSE_G "],\"parallel_tool_calls\":false", K3_CALLS_AUTO, false, false, 0},
        {"\"tools\":[" LOOSE_G "],\"parallel_tool_calls\":true", -1, false, false, 0},
        {"\"tools\":[" STRICT_F "],\"tool_choice\":\"none\"", -1, false, false, 0},
        {"\"tools\":[" STRICT_F "],\"response_format\":{\"type\":\"json_object\"}", -1, false, true, 0},
        {"\"parallel_tool_calls\":false", -1, false, false, 0},
    };
#undef STRICT_F
#undef LOOSE_G
    for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
        char body[1024];
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],%s}", C[i].rest);
        k3_serve_req r;
        k3_serve_error e;
        CHECKF(parse(body, K3_REQ_CHAT, &r, &e) == 0, "case %zu: %s", i, e.message);
        if (C[i].how < 0) {
            CHECKF(!r.call && !r.schema == !C[i].schema, "case %zu: enforced", i);
        } else {
            int how = -1;
            bool multi = false;
            size_t nt = 0;
            if (r.call) k3_callspec_shape(r.call, &how, &multi, &nt);
            CHECKF(r.call && how == C[i].how && multi == C[i].multi && nt == C[i].ntools,
                   "case %zu: how %d multi %d tools %zu", i, how, multi, nt);
        }
        k3_serve_req_free(&r);
    }
}

/* the released text of a whole feed, in pieces of `step` bytes */
static void run_stopper(char *const *stop, size_t nstop, const char *text, size_t step, char *out, size_t cap,
                        bool *hit) {
    k3_stopper s;
    k3_stopper_init(&s, stop, nstop);
    size_t n = strlen(text), len = 0;
    out[0] = 0;
    for (size_t i = 0; i < n; i += step) {
        const char *o;
        size_t no;
        k3_stopper_feed(&s, text + i, n - i < step ? n - i : step, &o, &no);
        if (len + no < cap) memcpy(out + len, o, no), len += no;
    }
    const char *o;
    size_t no;
    k3_stopper_flush(&s, &o, &no);
    if (len + no < cap) memcpy(out + len, o, no), len += no;
    out[len] = 0;
    *hit = s.hit;
    k3_stopper_free(&s);
}

TEST(serve_stop_strings) {
    char *stop[] = {"\n\n", "THE END", "ab"};
    char out[256];
    bool hit;
    static const struct { const char *text, *want; bool hit; } cases[] = {
        {"once upon a time", "once upon a time", false},
        {"once\n\nupon", "once", true},
        {"it was THE END. more", "it was ", true},
        {"THE EN", "THE EN", false},       /* a prefix at the end is released at the flush */
        {"xaab", "xa", true},
        {"a\nb\nTHE ENDab", "a\nb\n", true},
        {"THE ENab", "THE EN", true},      /* the earliest complete stop string wins */
        {"", "", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (size_t step = 1; step <= 5; step++) {
            run_stopper(stop, 3, cases[i].text, step, out, sizeof out, &hit);
            CHECKF(!strcmp(out, cases[i].want) && hit == cases[i].hit, "case %zu step %zu: '%s' (hit %d)", i, step,
                   out, hit);
        }
    /* no stop strings: everything passes through at once */
    k3_stopper s;
    k3_stopper_init(&s, NULL, 0);
    const char *o;
    size_t no;
    k3_stopper_feed(&s, "abc", 3, &o, &no);
    CHECK(no == 3 && !memcmp(o, "abc", 3));
    k3_stopper_free(&s);
}
