/* generate.c: the generation loop (generate.h). */
#include "generate/generate.h"

#include "draft/draft.h"

#include <stdlib.h>
#include <string.h>

void k3_gen_opts_init(k3_gen_opts *o) {
    memset(o, 0, sizeof *o);
    o->eos_id = -1;
    o->what = "the model";
}

void k3_gen_result_free(k3_gen_result *r) {
    free(r->ids);
    r->ids = NULL;
    r->n = 0;
}

const char *k3_gen_end_name(k3_gen_end e) {
    switch (e) {
    case K3_GEN_END_LENGTH: return "length";
    case K3_GEN_END_EOS: return "eos";
    case K3_GEN_END_STOP: return "stop";
    case K3_GEN_END_CANCEL: return "cancel";
    case K3_GEN_END_LOGITS: return "logits";
    case K3_GEN_END_ERROR: break;
    }
    return "error";
}

/* Ids the model has consumed now. */
static size_t consumed(const k3_session *s, const k3_gen_opts *o, const k3_gen_result *r) {
    return s ? k3_session_len(s) : o->prompt_len + (size_t)r->fed;
}

/* Whether one more id fits the model's positions. */
static bool has_room(k3_session *s, const k3_gen_opts *o, const k3_gen_result *r) {
    if (s) return k3_session_len(s) < (size_t)k3_state_max_pos(k3_session_state(s));
    return o->max_pos <= 0 || (int64_t)consumed(s, o, r) < o->max_pos;
}

/* Feeds id: logits NULL when nothing will read them. limit: ids the loop may
 * still feed after this one (drafts beyond it would never be verified). With
 * speculation the passes are counted from the speculator's figures. */
static int feed(k3_session *s, const k3_gen_opts *o, int32_t id, float *logits, int64_t limit, k3_gen_result *r,
                k3_err *err) {
    int rc;
    if (o->feed) rc = o->feed(o->ctx, id, logits, limit, err);
    else if (o->recompute) rc = k3_session_recompute(s, id, logits, err);
    else if (o->spec && logits) rc = k3_spec_feed(o->spec, s, id, logits, limit, err);
    else if (o->spec && (rc = k3_spec_finish(o->spec, s, err))) return rc;
    else rc = k3_session_feed(s, &id, 1, logits, err);
    if (rc) return rc;
    if (!o->spec || !logits) { /* a pass of its own; the speculator counts its own */
        r->passes++;
        r->fed++;
    }
    if (logits && o->on_logits) rc = o->on_logits(o->ctx, logits, err);
    return rc;
}

int k3_generate(k3_session *s, k3_sampler *sp, float *logits, const k3_gen_opts *o, k3_gen_result *r, k3_err *err) {
    memset(r, 0, sizeof *r);
    r->end = K3_GEN_END_LENGTH;
    if (!s && !o->feed) return k3_fail(err, K3_EXIT_USAGE, "generate: neither a session nor a feed");
    if (o->spec && (!s || o->feed || o->recompute))
        return k3_fail(err, K3_EXIT_USAGE, "generate: speculation needs a session the loop feeds itself");
    k3_spec_stats st0 = {0};
    if (o->spec) st0 = k3_spec_get_stats(o->spec);
    if (o->max_tokens < 0) return k3_fail(err, K3_EXIT_USAGE, "generate: max_tokens %lld < 0", (long long)o->max_tokens);
    size_t cap = o->max_tokens < 64 ? (size_t)o->max_tokens + 1 : 64;
    r->ids = xmalloc_array(cap, sizeof *r->ids);
    int rc = K3_OK;
    for (int64_t g = 0; g < o->max_tokens; g++) {
        if ((rc = k3_logits_check(logits, sp->n, o->what, consumed(s, o, r), err))) {
            r->end = K3_GEN_END_LOGITS;
            return rc;
        }
        const float *row = o->adjust ? o->adjust(o->ctx, logits) : logits;
        int32_t id = k3_sample(sp, row);
        if (g == 0) r->t_first = k3_now();
        if (r->n == cap) {
            cap *= 2;
            r->ids = xrealloc_array(r->ids, cap, sizeof *r->ids);
        }
        r->ids[r->n++] = id;
        if (o->on_sample && (rc = o->on_sample(o->ctx, id, row, err))) break;
        k3_gen_verdict v = K3_GEN_GO;
        if (id == o->eos_id) {
            r->end = K3_GEN_END_EOS;
            v = o->eos_keep ? K3_GEN_STOP_KEEP : K3_GEN_STOP;
        } else if (o->on_token && (rc = o->on_token(o->ctx, id, &v, err))) {
            break;
        } else if (v != K3_GEN_GO) {
            r->end = K3_GEN_END_STOP;
        }
        if (v == K3_GEN_STOP_KEEP) {
            if (o->spec && (rc = k3_spec_finish(o->spec, s, err))) break; /* before has_room: drafts hold positions */
            if (has_room(s, o, r)) rc = feed(s, o, id, NULL, 0, r, err);
            break;
        }
        if (v == K3_GEN_STOP || g + 1 == o->max_tokens) break;
        if (o->cancelled && o->cancelled(o->ctx)) {
            r->end = K3_GEN_END_CANCEL;
            break;
        }
        if ((rc = feed(s, o, id, logits, o->max_tokens - g - 2, r, err))) break;
    }
    if (o->spec) { /* the session ends holding exactly the ids fed, as without drafts */
        if (!rc) rc = k3_spec_finish(o->spec, s, err);
        k3_spec_stats st = k3_spec_get_stats(o->spec);
        r->passes += st.passes - st0.passes;
        r->fed += st.fed - st0.fed;
        r->drafted = st.proposed - st0.proposed;
        r->accepted = st.accepted - st0.accepted;
    }
    if (rc) r->end = K3_GEN_END_ERROR;
    return rc;
}
