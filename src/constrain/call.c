/* call.c: the tools a constrained reply may call (constrain.h): each
 * callable tool's name and parameters as the text the reply's call header
 * and argument headers spell, and the compiled schema its values are held
 * to; a tool whose calls are not enforced (not strict, under "auto") keeps
 * only its name. */
#include "constrain/internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const struct k3_call_type k3_call_types[K3_NCALL_TYPES] = {
    {"string\"", T_STR}, {"number\"", T_NUM | T_INT}, {"boolean\"", T_BOOL},
    {"null\"", T_NULL},  {"array\"", T_ARR},          {"object\"", T_OBJ}};

/* s as the template writes an attribute value (& and " as entities), then
 * tail. */
static char *attr_text(const char *s, size_t n, const char *tail, uint32_t *len) {
    k3_sbuf b = {0};
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '&') k3_sb_puts(&b, "&amp;");
        else if (s[i] == '"') k3_sb_puts(&b, "&quot;");
        else k3_sb_putc(&b, s[i]);
    }
    k3_sb_puts(&b, tail);
    *len = (uint32_t)b.n;
    return b.p;
}

static void tool_free(k3_calltool *t) {
    for (size_t j = 0; j < t->nargs; j++) free(t->khead[j]);
    free(t->khead);
    free(t->nkhead);
    free(t->ntypes);
    free(t->head);
    k3_jschema_free(t->params);
}

void k3_callspec_free(k3_callspec *cs) {
    if (!cs) return;
    for (size_t i = 0; i < cs->n; i++) tool_free(&cs->t[i]);
    free(cs->t);
    free(cs);
}

void k3_callspec_shape(const k3_callspec *cs, int *how, bool *multi, size_t *ntools) {
    *how = cs->how;
    *multi = cs->multi;
    *ntools = cs->n;
}

static int refuse(char *where, size_t nwhere, k3_err *err, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int refuse(char *where, size_t nwhere, k3_err *err, const char *path, const char *fmt, ...) {
    snprintf(where, nwhere, "%s", path);
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return k3_fail(err, K3_EXIT_USAGE, "%s", msg);
}

/* Tool i: its header text, parameters and argument headers (loose: its
 * name only). */
static int tool_compile(const json_t *fn, size_t i, bool loose, k3_calltool *t, char *where, size_t nwhere,
                        k3_err *err) {
    char path[64];
    const json_t *name = json_object_get(fn, "name");
    snprintf(path, sizeof path, "tools[%zu].function.name", i);
    if (!json_is_string(name) || !json_string_length(name))
        return refuse(where, nwhere, err, path, "expected a non-empty string");
    const char *nm = json_string_value(name);
    size_t nl = json_string_length(name);
    if (memchr(nm, 0, nl)) return refuse(where, nwhere, err, path, "a tool name cannot hold U+0000");
    /* the index's digits follow an enforced head (they count the calls) */
    t->loose = loose;
    t->head = attr_text(nm, nl, loose ? "\"" : "\" index=\"", &t->nhead);
    if (t->nhead > K3_CALL_MAX_NAME)
        return refuse(where, nwhere, err, path, "'%.60s...' is too long to be enforced as a call", nm);
    if (loose) return K3_OK;
    const json_t *params = json_object_get(fn, "parameters");
    if (!params || json_is_null(params)) return K3_OK;
    snprintf(path, sizeof path, "tools[%zu].function.parameters", i);
    char sub[512];
    if (k3_jschema_compile(params, &t->params, sub, sizeof sub, err)) {
        snprintf(where, nwhere, "%s%s%s", path, *sub ? "." : "", sub);
        return err->code;
    }
    const jnode *root = &t->params->nodes[t->params->root];
    if (!(root->types & T_OBJ) || root->nlit)
        return refuse(where, nwhere, err, path,
                      "the parameters must be an object schema (type object, no enum or const)");
    t->nargs = root->nprops;
    t->required = root->required;
    size_t na = t->nargs ? t->nargs : 1;
    t->khead = xcalloc(na, sizeof *t->khead);
    t->nkhead = xcalloc(na, sizeof *t->nkhead);
    t->ntypes = xcalloc(na, sizeof *t->ntypes);
    for (size_t j = 0; j < t->nargs; j++) {
        const char *k = root->names[j];
        snprintf(sub, sizeof sub, "%s.properties.%.200s", path, k);
        t->khead[j] = attr_text(k, strlen(k), "\" type=\"", &t->nkhead[j]);
        if (t->nkhead[j] > K3_CALL_MAX_NAME)
            return refuse(where, nwhere, err, sub, "the name '%.60s...' is too long to be enforced as an argument", k);
        const jnode *p = &t->params->nodes[root->pnode[j]];
        uint8_t eff = p->types;
        if (p->nlit) {
            eff = 0;
            for (size_t v = 0; v < p->nlit; v++) eff |= k3_jkind_bits(p->litv[v]);
            eff &= p->types;
        }
        for (int ty = 0; ty < K3_NCALL_TYPES; ty++)
            if (k3_call_types[ty].bits & eff) t->ntypes[j] |= (uint8_t)(1u << ty);
    }
    return K3_OK;
}

/* Two tools of one name (a head's name ends at its first quote: a quote
 * in a name is an entity). */
static bool same_name(const k3_calltool *a, const k3_calltool *b) {
    size_t n = strcspn(a->head, "\"");
    return n == strcspn(b->head, "\"") && !memcmp(a->head, b->head, n);
}

static bool is_strict(const json_t *fn) { return json_is_true(json_object_get(fn, "strict")); }

int k3_callspec_compile(const json_t *tools, int how, const char *name, bool parallel, k3_callspec **out, char *where,
                        size_t nwhere, k3_err *err) {
    *out = NULL;
    if (nwhere) where[0] = 0;
    char dummy[4];
    if (!nwhere) {
        where = dummy;
        nwhere = sizeof dummy;
    }
    if (how != K3_CALLS_NAMED) name = NULL;
    size_t nt = json_array_size(tools), nstrict = 0;
    for (size_t i = 0; i < nt; i++) nstrict += is_strict(json_object_get(json_array_get(tools, i), "function"));
    /* under auto only strict calls and the count are enforced: with
     * neither there is nothing to enforce */
    if (how == K3_CALLS_AUTO && (!nt || (!nstrict && parallel))) return K3_OK;
    /* names are chosen among all the tools wherever one is enforced */
    bool choose = how != K3_CALLS_AUTO || nstrict;
    if (choose && !name && nt > K3_CALL_MAX_TOOLS)
        return refuse(where, nwhere, err, "tools", "at most %d tools can be enforced as a choice (got %zu)",
                      K3_CALL_MAX_TOOLS, nt);
    k3_callspec *cs = xcalloc(1, sizeof *cs);
    cs->how = how;
    cs->multi = how != K3_CALLS_NAMED && parallel;
    cs->t = xcalloc(nt ? nt : 1, sizeof *cs->t);
    int rc = K3_OK;
    for (size_t i = 0; i < nt && !rc && choose; i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        const json_t *nm = json_object_get(fn, "name");
        if (name && !(json_is_string(nm) && !strcmp(json_string_value(nm), name))) continue;
        k3_calltool *t = &cs->t[cs->n++];
        rc = tool_compile(fn, i, how == K3_CALLS_AUTO && !is_strict(fn), t, where, nwhere, err);
        for (size_t j = 0; j + 1 < cs->n && !rc; j++)
            if (same_name(&cs->t[j], t)) {
                char path[64];
                snprintf(path, sizeof path, "tools[%zu].function.name", i);
                rc = refuse(where, nwhere, err, path, "'%.60s' is declared twice", json_string_value(nm));
            }
    }
    if (!rc && choose && !cs->n)
        rc = refuse(where, nwhere, err, "tools", "%s", name ? "the named tool is not declared" : "no tools");
    if (rc) {
        k3_callspec_free(cs);
        return rc;
    }
    *out = cs;
    return K3_OK;
}
