/* schema.c: JSON Schema (the subset constrain.h names) to a node table, and
 * the validator enum/const values are filtered with. */
#include "constrain/internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LIT_FLAGS (JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(17))

/* Keywords that describe but do not constrain: accepted, no effect. */
static const char *const ANNOTATIONS[] = {"title", "description", "default", "examples", "$schema", "$id",
                                          "$comment", "deprecated", "readOnly", "writeOnly", NULL};
static const char *const KEYWORDS[] = {"type", "properties", "required", "enum", "const", "items",
                                       "additionalProperties", NULL};

typedef struct {
    k3_jschema *s;
    char *where;
    size_t nwhere;
    k3_err *err;
} cctx;

static bool in_list(const char *k, const char *const *l) {
    for (; *l; l++)
        if (!strcmp(k, *l)) return true;
    return false;
}

static int refuse(cctx *c, const char *path, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int refuse(cctx *c, const char *path, const char *key, const char *fmt, ...) {
    snprintf(c->where, c->nwhere, "%s%s%s", path, *path && key && *key ? "." : "", key ? key : "");
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return k3_fail(c->err, K3_EXIT_USAGE, "%s", msg);
}

static int new_node(cctx *c, const char *path, int32_t *out) {
    k3_jschema *s = c->s;
    if (s->n >= K3_JSCHEMA_MAX_NODES)
        return refuse(c, path, NULL, "the schema has more than %d subschemas", K3_JSCHEMA_MAX_NODES);
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 16;
        s->nodes = xrealloc_array(s->nodes, s->cap, sizeof *s->nodes);
    }
    jnode *n = &s->nodes[s->n];
    memset(n, 0, sizeof *n);
    n->types = T_ANY;
    n->addl = 0;
    n->items = 0;
    *out = (int32_t)s->n++;
    return 0;
}

static void lit_set(jlit *l, const json_t *v) {
    char *t = json_dumps(v, LIT_FLAGS);
    if (!t) {
        fprintf(stderr, "k3: out of memory (schema literal)\n");
        exit(K3_EXIT_RUNTIME);
    }
    l->s = t;
    l->n = (uint32_t)strlen(t);
}

static int parse_type(cctx *c, const json_t *v, const char *path, uint8_t *out) {
    static const struct {
        const char *name;
        uint8_t bit;
    } T[] = {{"object", T_OBJ}, {"array", T_ARR},  {"string", T_STR}, {"number", T_NUM},
             {"integer", T_INT}, {"boolean", T_BOOL}, {"null", T_NULL}};
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (!json_is_string(v) && (!json_is_array(v) || n == 0))
        return refuse(c, path, "type", "type: expected a type name or a non-empty array of them");
    *out = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *t = json_is_array(v) ? json_array_get(v, i) : v;
        const char *name = json_string_value(t);
        size_t k = 0;
        while (name && k < sizeof T / sizeof T[0] && strcmp(name, T[k].name)) k++;
        if (!name || k == sizeof T / sizeof T[0])
            return refuse(c, path, "type", "type: '%.40s' is not one of object, array, string, number, integer, "
                          "boolean, null", name ? name : "(not a string)");
        *out |= T[k].bit;
    }
    return 0;
}

static bool node_valid(const k3_jschema *s, int32_t idx, const json_t *v, bool skip_lit);

static int compile(cctx *c, const json_t *sch, int depth, const char *path, int32_t *out) {
    if (json_is_true(sch)) {
        *out = 0;
        return 0;
    }
    if (json_is_false(sch)) return refuse(c, path, NULL, "the schema false matches nothing");
    if (!json_is_object(sch)) return refuse(c, path, NULL, "a schema must be an object or a boolean");
    if (depth > K3_JSCHEMA_MAX_DEPTH)
        return refuse(c, path, NULL, "the schema nests deeper than %d levels", K3_JSCHEMA_MAX_DEPTH);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)sch, k, v) {
        if (!in_list(k, KEYWORDS) && !in_list(k, ANNOTATIONS))
            return refuse(c, path, k, "'%.60s' is not supported in a schema (supported: type, properties, required, "
                          "enum, const, items, additionalProperties; annotations title, description, ...)", k);
    }
    int32_t idx;
    int rc = new_node(c, path, &idx);
    if (rc) return rc;
    char sub[1024];
    const json_t *t = json_object_get(sch, "type");
    uint8_t types = T_ANY;
    if (t && (rc = parse_type(c, t, path, &types))) return rc;
    c->s->nodes[idx].types = types;
    const json_t *props = json_object_get(sch, "properties");
    if (props) {
        if (!json_is_object(props)) return refuse(c, path, "properties", "properties: expected an object");
        size_t np = json_object_size(props);
        if (np > K3_JSCHEMA_MAX_SET)
            return refuse(c, path, "properties", "properties: at most %d, got %zu", K3_JSCHEMA_MAX_SET, np);
        jnode *n = &c->s->nodes[idx];
        n->nprops = (uint16_t)np;
        n->keys = xcalloc(np ? np : 1, sizeof *n->keys);
        n->names = xcalloc(np ? np : 1, sizeof *n->names);
        n->khash = xcalloc(np ? np : 1, sizeof *n->khash);
        n->pnode = xcalloc(np ? np : 1, sizeof *n->pnode);
        size_t i = 0;
        json_object_foreach((json_t *)props, k, v) {
            n = &c->s->nodes[idx];
            json_t *name = json_string(k);
            if (!name) return refuse(c, path, "properties", "properties: a name is not valid UTF-8");
            lit_set(&n->keys[i], name);
            json_decref(name);
            n->names[i] = xstrdup(k);
            uint64_t h = K3_JHASH_INIT;
            for (const char *p = k; *p; p++) h = k3_jhash_byte(h, (uint8_t)*p);
            n->khash[i] = h;
            snprintf(sub, sizeof sub, "%s%sproperties.%.200s", path, *path ? "." : "", k);
            int32_t child;
            if ((rc = compile(c, v, depth + 1, sub, &child))) return rc;
            c->s->nodes[idx].pnode[i] = (uint16_t)child;
            i++;
        }
    }
    jnode *n = &c->s->nodes[idx];
    const json_t *req = json_object_get(sch, "required");
    if (req) {
        if (!json_is_array(req)) return refuse(c, path, "required", "required: expected an array of names");
        for (size_t i = 0; i < json_array_size(req); i++) {
            const char *name = json_string_value(json_array_get(req, i));
            if (!name) return refuse(c, path, "required", "required[%zu]: expected a string", i);
            size_t j = 0;
            while (j < n->nprops && strcmp(n->names[j], name)) j++;
            if (j == n->nprops)
                return refuse(c, path, "required", "required: '%.60s' is not in properties (a required name must be "
                              "declared there)", name);
            n->required |= 1ULL << j;
        }
    }
    const json_t *ap = json_object_get(sch, "additionalProperties");
    if (ap) {
        if (json_is_false(ap)) {
            n->addl = -1;
        } else if (json_is_true(ap) || json_is_object(ap)) {
            snprintf(sub, sizeof sub, "%s%sadditionalProperties", path, *path ? "." : "");
            int32_t child;
            if ((rc = compile(c, ap, depth + 1, sub, &child))) return rc;
            c->s->nodes[idx].addl = child;
        } else {
            return refuse(c, path, "additionalProperties", "additionalProperties: expected a boolean or a schema");
        }
    }
    const json_t *items = json_object_get(sch, "items");
    if (items) {
        if (json_is_array(items))
            return refuse(c, path, "items", "items: the array (tuple) form is not supported; give one schema");
        if (!json_is_object(items) && !json_is_boolean(items))
            return refuse(c, path, "items", "items: expected a schema");
        snprintf(sub, sizeof sub, "%s%sitems", path, *path ? "." : "");
        int32_t child;
        if ((rc = compile(c, items, depth + 1, sub, &child))) return rc;
        c->s->nodes[idx].items = child;
    }
    /* enum and const last: their values are kept only when the rest of the
     * node accepts them */
    const json_t *en = json_object_get(sch, "enum"), *cn = json_object_get(sch, "const");
    if (en || cn) {
        if (en && (!json_is_array(en) || json_array_size(en) == 0))
            return refuse(c, path, "enum", "enum: expected a non-empty array");
        if (en && json_array_size(en) > K3_JSCHEMA_MAX_SET)
            return refuse(c, path, "enum", "enum: at most %d values, got %zu", K3_JSCHEMA_MAX_SET, json_array_size(en));
        size_t nv = en ? json_array_size(en) : 1;
        n = &c->s->nodes[idx];
        n->lit = xcalloc(nv, sizeof *n->lit);
        n->litv = xcalloc(nv, sizeof *n->litv);
        for (size_t i = 0; i < nv; i++) {
            const json_t *x = en ? json_array_get(en, i) : cn;
            if (en && cn && !json_equal(x, cn)) continue;
            if (!node_valid(c->s, idx, x, true)) continue;
            jlit l;
            lit_set(&l, x);
            bool dup = false;
            for (size_t j = 0; j < n->nlit && !dup; j++) dup = n->lit[j].n == l.n && !memcmp(n->lit[j].s, l.s, l.n);
            if (dup || l.n > K3_JSCHEMA_MAX_LIT) {
                free(l.s);
                if (dup) continue;
                return refuse(c, path, en ? "enum" : "const", "%s: a value is longer than %d bytes as JSON",
                              en ? "enum" : "const", K3_JSCHEMA_MAX_LIT);
            }
            n->litv[n->nlit] = json_deep_copy(x);
            n->lit[n->nlit++] = l;
        }
        if (!n->nlit)
            return refuse(c, path, en ? "enum" : "const", "%s: no value is valid against the rest of its schema",
                          en ? "enum" : "const");
    }
    *out = idx;
    return 0;
}

int k3_jschema_compile(const json_t *schema, k3_jschema **out, char *where, size_t nwhere, k3_err *err) {
    *out = NULL;
    if (nwhere) where[0] = 0;
    char dummy[4];
    cctx c = {.s = xcalloc(1, sizeof(k3_jschema)), .where = nwhere ? where : dummy,
              .nwhere = nwhere ? nwhere : sizeof dummy, .err = err};
    int32_t any, root = 0;
    new_node(&c, "", &any); /* node 0: any value */
    int rc;
    if (schema) {
        rc = compile(&c, schema, 1, "", &root);
    } else {
        rc = new_node(&c, "", &root);
        c.s->nodes[root].types = T_OBJ;
    }
    if (rc) {
        k3_jschema_free(c.s);
        return rc;
    }
    c.s->root = (uint16_t)root;
    *out = c.s;
    return K3_OK;
}

void k3_jschema_free(k3_jschema *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n; i++) {
        jnode *n = &s->nodes[i];
        for (size_t j = 0; j < n->nlit; j++) {
            free(n->lit[j].s);
            json_decref(n->litv[j]);
        }
        for (size_t j = 0; j < n->nprops; j++) {
            free(n->keys[j].s);
            free(n->names[j]);
        }
        free(n->lit);
        free(n->litv);
        free(n->keys);
        free(n->names);
        free(n->khash);
        free(n->pnode);
    }
    free(s->nodes);
    free(s);
}

static bool node_valid(const k3_jschema *s, int32_t idx, const json_t *v, bool skip_lit) {
    const jnode *n = &s->nodes[idx];
    if (n->nlit && !skip_lit) {
        bool any = false;
        for (size_t i = 0; i < n->nlit && !any; i++) any = json_equal(n->litv[i], (json_t *)v);
        if (!any) return false;
    }
    uint8_t t = n->types;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        if (!(t & T_OBJ)) return false;
        uint64_t seen = 0;
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) {
            size_t j = 0;
            while (j < n->nprops && strcmp(n->names[j], k)) j++;
            if (j < n->nprops) {
                seen |= 1ULL << j;
                if (!node_valid(s, n->pnode[j], x, false)) return false;
            } else if (n->addl < 0 || !node_valid(s, n->addl, x, false)) {
                return false;
            }
        }
        return (seen & n->required) == n->required;
    }
    case JSON_ARRAY:
        if (!(t & T_ARR)) return false;
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!node_valid(s, n->items, json_array_get(v, i), false)) return false;
        return true;
    case JSON_STRING: return t & T_STR;
    case JSON_INTEGER: return t & (T_INT | T_NUM);
    case JSON_REAL: {
        double d = json_real_value(v);
        return (t & T_NUM) || ((t & T_INT) && d == floor(d));
    }
    case JSON_TRUE:
    case JSON_FALSE: return t & T_BOOL;
    case JSON_NULL: return t & T_NULL;
    }
    return false;
}

bool k3_jschema_valid(const k3_jschema *s, const json_t *v) { return node_valid(s, s->root, v, false); }
