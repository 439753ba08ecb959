/* session.h: conversations that never re-prefill.
 *
 * A session is one decode state plus the exact token ids it has consumed
 * (ids[0..pos)). A state cache, shared by any number of sessions (k3 serve
 * keeps one for all requests), holds snapshots of states at chosen positions
 * under a byte budget. k3_session_prefill(s, ids, n, ...) brings the session
 * to "has consumed ids[0..n)" with the least work:
 *
 *   1. the session's own ids are a prefix of ids: feed only ids[pos..n);
 *   2. else (or when a snapshot reaches deeper) resume from the deepest cached
 *      snapshot whose ids are a prefix of ids[0..n-1] and feed the rest;
 *   3. else start cold at position 0.
 *
 * Typical use (k3 chat; k3 serve shares one cache between requests):
 *
 *     k3_state_cache *sc = k3_state_cache_new(e->cfg, budget_bytes, 0);
 *     k3_state *st;      k3_engine_state_new(e, max_pos, budget_bytes, &st, &err);
 *     k3_session *s = k3_session_open(e, st, sc);
 *     each turn:  k3_session_prefill(s, prompt, n, logits, &reused, &err);
 *                 per generated id: k3_session_feed(s, &id, 1, logits, &err);
 *                 k3_session_snapshot(s);                       // the turn end
 *     k3_session_free(s); k3_engine_state_free(e, st); k3_state_cache_free(sc);
 *
 * Invariants (the reuse contract, tested bit for bit in tests/test_session.c
 * and tests/cli/test_chat.sh):
 *  - the logits prefill returns equal, bit for bit, the logits of a cold
 *    prefill of ids[0..n) on a fresh state, at every thread count and memory
 *    budget (resident or streamed weights). This rests on the model's
 *    arithmetic contract (model.h: any split of a sequence gives the same
 *    bits) and therefore needs the recurrent KDA form (kda_chunk 0, the
 *    default): with --kda-chunk a prefill split at other places differs in the
 *    last bits;
 *  - a state is never rewound: the KDA part is recurrent, so a prompt that
 *    matches the session or a snapshot only partly resumes from a snapshot
 *    taken at or before the first differing token, never from a longer state
 *    cut back (the MLA cache alone could be truncated, the KDA state cannot);
 *  - a snapshot is found by a hash of its exact id prefix and then verified
 *    against the ids themselves, so a hash collision can never resume the
 *    wrong state;
 *  - prefill feeds at least one token (the logits of the last prompt token
 *    are needed) unless the session already consumed exactly ids[0..n) and
 *    still holds that token's logits, or a snapshot of exactly ids[0..n)
 *    kept them (a snapshot taken while the session held the logits of its
 *    last id keeps a copy: every prompt end does; grid snapshots, taken
 *    between forward calls, do not).
 *
 * Snapshots are taken (a) at the end of every prefill (the prompt end: the
 * next turn re-renders the conversation and shares at least this prefix),
 * (b) when the caller marks a turn end (k3_session_snapshot, after a reply),
 * (b') at the boundaries a marked prefill names (k3_session_prefill_marked:
 * message ends, so a new conversation with the same system prompt resumes
 * at its end), (c) whenever the position reaches a multiple of the cache's grid G while
 * feeding (K3_STATE_CACHE_GRID by default), so a prompt that diverges inside
 * a long stretch (an edited earlier message, a re-rendered reply that differs
 * from what was generated) loses at most G tokens of work.
 *
 * Memory. A snapshot at position p holds the KDA part of the state (every KDA
 * layer's S [H][D][D] and ShortConv history [3][H*D][K-1], a fixed size) and
 * the MLA latent rows [0, p) (W = kv_lora_rank + qk_rope_head_dim floats per
 * MLA layer per position). MLA rows are shared between snapshots of the same
 * conversation: each snapshot stores only the rows past the snapshot it was
 * grown from (a chain of reference-counted segments), so a snapshot costs its
 * KDA part plus the rows no earlier snapshot of its conversation holds, plus
 * vocab floats when it keeps logits.
 * k3_state_snapshot_bytes (model.h) gives the unshared size. The cache evicts
 * the least recently used snapshots to stay within its budget; segments still
 * used by a live session or by a newer snapshot stay until released (they are
 * counted in the cache's bytes).
 *
 * Threads: the cache has its own lock, so sessions on different threads may
 * share it; one session is used by one thread at a time. */
#ifndef K3_SESSION_H
#define K3_SESSION_H

#include "engine/engine.h"
#include "model/model.h"
#include "util/common.h"

/* Positions between grid snapshots by default. For the full release a
 * snapshot's fixed part is ~465 MB (k3 chat prints it), so the grid is coarse;
 * small models can afford a finer one (k3_state_cache_new's grid). */
#define K3_STATE_CACHE_GRID 1024
/* Default budget of the state cache of k3 chat / k3 serve (--state-cache-gb 2). */
#define K3_STATE_CACHE_BYTES_DEFAULT 2000000000ull
/* The value of k3 chat's and k3 serve's --state-cache-gb G: GB of 10^9
 * bytes, as the other --*-gb flags count them; 0 keeps no snapshots. A value
 * that is not a number in [0, 10^6] is a usage error naming cmd. */
int k3_state_cache_parse_gb(const char *cmd, const char *v, uint64_t *bytes, k3_err *err);

typedef struct k3_state_cache k3_state_cache;
typedef struct k3_session k3_session;

/* A cache for states of models with config c (kept by value), holding at most
 * budget_bytes of snapshots (0: keeps none, every prefill is then served by
 * the session's own state or cold); grid <= 0: K3_STATE_CACHE_GRID. */
k3_state_cache *k3_state_cache_new(const k3_config *c, uint64_t budget_bytes, int grid);
void k3_state_cache_free(k3_state_cache *sc);  /* after every session using it is freed */
void k3_state_cache_clear(k3_state_cache *sc); /* drops every snapshot */

typedef struct {
    uint64_t bytes;        /* KDA parts + MLA row segments held now */
    uint64_t budget;
    int grid;
    int snapshots;         /* snapshots held now */
    uint64_t taken, hits, evicted;  /* totals: snapshots stored, prefills resumed from one, evictions */
    uint64_t kda_bytes;    /* fixed part of one snapshot */
    uint64_t row_bytes;    /* MLA bytes per position of one snapshot */
} k3_state_cache_stats;
k3_state_cache_stats k3_state_cache_get_stats(k3_state_cache *sc);

/* A session on model m with state st (both the caller's; st is used and reset
 * by the session, and must not be fed by anyone else while the session lives).
 * cache may be NULL (no snapshots: only case 1 above); it must have been made
 * for m's config (a cache of another state shape is ignored). The state's
 * max_pos bounds every prompt (longer: K3_EXIT_USAGE, session unchanged). */
k3_session *k3_session_new(k3_model *m, k3_state *st, k3_state_cache *cache);
/* The same on an engine (the usual way): tokens go through k3_engine_feed, so
 * the plan's chunks, weight source and run report apply; st from
 * k3_engine_state_new (count the cache's budget in its extra_bytes). */
k3_session *k3_session_open(k3_engine *e, k3_state *st, k3_state_cache *cache);
void k3_session_free(k3_session *s);
/* Back to position 0, nothing consumed (the cache keeps its snapshots). */
void k3_session_reset(k3_session *s);

/* Brings the session to "has consumed ids[0..n)" (n >= 1) as described above
 * and writes the logits of ids[n-1] to logits[V] (NULL: not wanted). *reused
 * (may be NULL): how many of the n tokens were not fed (taken from the
 * session's state or a snapshot). Errors: a prompt longer than the state
 * (K3_EXIT_USAGE, session unchanged); those of the forward pass, after which
 * the session is reset. */
int k3_session_prefill(k3_session *s, const int32_t *ids, size_t n, float *logits, size_t *reused, k3_err *err);
/* k3_session_prefill that also snapshots the state at each marked boundary
 * it feeds past: marks[0..nmarks) are increasing offsets in 1..n (else
 * K3_EXIT_USAGE, session unchanged), e.g. where each message of a rendered
 * conversation ends (k3_chat_encode_marked), so that another prompt sharing
 * ids[0..mark) (the same system prompt, the same earlier messages) resumes
 * there. A mark at or before the resume point, or at n (the prompt end is
 * snapshotted anyway), takes nothing. Each mark taken ends one forward call
 * (the feed is split there: the same bits, at most one more call per mark)
 * and costs one snapshot's KDA part in the cache (LRU like the others). */
int k3_session_prefill_marked(k3_session *s, const int32_t *ids, size_t n, const size_t *marks, size_t nmarks,
                              float *logits, size_t *reused, k3_err *err);
/* A hook k3_session_prefill asks before each forward call of its feeding
 * (each at most the engine's prefill chunk); NULL: none. Once cancelled(ctx)
 * is true the prefill stops with K3_EXIT_RUNTIME ("cancelled after K of N
 * prompt tokens (R reused)"), and the session then holds exactly the ids it
 * consumed: a shorter but true state, which the next prefill of the same
 * prompt continues (its logits still equal a cold prefill's). The prompt's end
 * is not snapshotted; grid snapshots taken on the way are of positions fed in
 * full. k3 serve's hook reads the flag a vanished client sets. */
void k3_session_set_cancel(k3_session *s, bool (*cancelled)(const void *ctx), const void *ctx);
/* Appends n tokens (decoding: the sampled id) and writes the logits of the
 * last to logits[V] (NULL: none). Grid snapshots are taken on the way. */
int k3_session_feed(k3_session *s, const int32_t *ids, size_t n, float *logits, k3_err *err);
/* k3_session_feed with k3_engine_feed's choices: all_rows: logits holds
 * [n][V], row i the logits after ids[i] (k3 run --dump-logits; a pass that
 * verifies several ids at once); prompt: the forward calls count as prompt
 * work in the run report. */
int k3_session_feed_rows(k3_session *s, const int32_t *ids, size_t n, float *logits, bool all_rows, bool prompt,
                         k3_err *err);
/* Batched decoding: appends ids[q] to sessions ss[q] (n distinct sessions on
 * one engine or model) in one forward pass (k3_engine_feed_batch), and writes
 * each one's logits to logits[q] ([V]; logits or logits[q] NULL: none, and
 * that session then holds none, as k3_session_feed without logits). Each
 * session ends exactly as k3_session_feed of its id alone leaves it: the same
 * logits bits, state, ids and grid snapshots, whatever the other sessions
 * are (a session inside a pass records its id as k3_session_feed does). A
 * full session or an id outside the vocabulary: K3_EXIT_USAGE and no session
 * changed; an error of the forward pass resets every session of the batch. */
int k3_session_feed_batch(k3_session *const *ss, int n, const int32_t *ids, float *const *logits, k3_err *err);
/* The same with counts[q] >= 1 ids for session ss[q] (counts NULL: one
 * each; engine.h's k3_engine_feed_batch_rows): ids holds them one session
 * after another, and rows[q] (rows or rows[q] NULL: none) gets every row of
 * session q, [counts[q]][V]. Each session ends exactly as
 * k3_session_feed_rows(ss[q], its ids, counts[q], rows[q], true, false)
 * alone leaves it: the same rows bits, state, ids, pass record (a
 * verifying pass of several sessions in one pass over the weights) and grid
 * snapshots. Besides k3_session_feed_batch's refusals: several ids outside a
 * pass that would cross a grid line (feeding alone stops there to snapshot),
 * and a batch of more ids than the engine's chunk. */
int k3_session_feed_batch_rows(k3_session *const *ss, int n, const int *counts, const int32_t *ids,
                               float *const *rows, k3_err *err);
/* Appends id and recomputes the state from position 0 over every id the
 * session holds (k3 run --full, a check: the logits are bit-identical to
 * k3_session_feed's). No snapshots are taken. */
int k3_session_recompute(k3_session *s, int32_t id, float *logits, k3_err *err);
/* Speculation: a pass whose fed ids may be taken back (model.h,
 * k3_state_pass_*). pass_begin reserves the state's record for passes of up
 * to max_T ids (the first time, or a larger max_T) and opens one at the
 * current length; the ids fed until pass_end are recorded; pass_end keeps
 * the first keep of them (the state then equals plain feeding of only
 * those, bit for bit, and the session's ids are cut to match). No grid
 * snapshot is taken inside a pass (a draft may be taken back); one is taken
 * at pass_end when the kept ids crossed a grid line. After a cut-back pass
 * the session holds no logits (the next prefill of its own ids feeds). */
int k3_session_pass_begin(k3_session *s, int max_T, k3_err *err);
int k3_session_pass_end(k3_session *s, size_t keep, k3_err *err);
bool k3_session_in_pass(const k3_session *s);
/* Stores a snapshot of the current position in the cache (a turn end). */
void k3_session_snapshot(k3_session *s);

size_t k3_session_len(const k3_session *s);          /* tokens consumed */
const int32_t *k3_session_ids(const k3_session *s);  /* valid until the next call */
k3_state *k3_session_state(k3_session *s);
/* Where the last prefill resumed from: 0 cold, 1 the session's own state,
 * 2 a cached snapshot. */
int k3_session_last_source(const k3_session *s);

/* ---- session files ---------------------------------------------------------
 * A session (its ids, the state at its position, and an opaque extra blob,
 * e.g. k3 chat's messages) saved atomically (temp file, fsync, rename). Layout
 * (little-endian):
 *   magic "K3SESSN\n" | u32 version (1) | u32 header bytes (64)
 *   u64 model identity (engine.h: k3_engine_identity) | u64 n_ids | u64 state bytes | u64 extra bytes
 *   u32 payload CRC-32C | u32 0 | u64 0 | u32 header CRC-32C (of the 60 bytes before) | u32 0
 *   payload: ids (n_ids x i32) | state (k3_state_save) | extra
 * Load refuses (K3_EXIT_DATA, one line) a file that is truncated, has a bad
 * magic or checksum, another version, another model identity, or a state of
 * another size; the session is unchanged then. */
int k3_session_save(const k3_session *s, const char *path, uint64_t model_id, const void *extra, size_t extra_len,
                    k3_err *err);
/* On success *extra (malloc'd, NUL-terminated past *extra_len; may be NULL
 * if extra is NULL) holds the extra blob and the session is at the saved
 * position (its next prefill feeds only what follows the saved ids). */
int k3_session_load(k3_session *s, const char *path, uint64_t model_id, char **extra, size_t *extra_len,
                    k3_err *err);

#endif
