/* cache.c: expert cache policies, trace I/O and the replay simulator.
 * The cache is an open-addressing hash map (key -> slot) plus an indexed
 * binary heap over the slots whose order is the policy's eviction order, so
 * every policy costs O(log capacity) per request. */
#include "memory/cache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define EMPTY UINT64_MAX

typedef struct {
    uint64_t key;
    uint64_t last;      /* tick of the last use */
    uint64_t freq;      /* uses so far (LFU) */
    uint64_t next;      /* index of the next request for this key (BELADY) */
    int32_t step_in;    /* step in which it was inserted */
    size_t heap_pos;
} slot;

/* key -> int64 map, open addressing with linear probing, grows at 1/2 load */
typedef struct {
    uint64_t *keys;
    int64_t *vals;
    size_t cap, n;
} map;

static uint64_t hash64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static void map_init(map *m, size_t cap) {
    m->cap = 16;
    while (m->cap < cap * 2) m->cap *= 2;
    m->keys = xmalloc_array(m->cap, sizeof *m->keys);
    m->vals = xmalloc_array(m->cap, sizeof *m->vals);
    for (size_t i = 0; i < m->cap; i++) m->keys[i] = EMPTY;
    m->n = 0;
}

static int64_t *map_find(const map *m, uint64_t key) {
    for (size_t i = hash64(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) return &m->vals[i];
        if (m->keys[i] == EMPTY) return NULL;
    }
}

static void map_put(map *m, uint64_t key, int64_t val);

static void map_grow(map *m) {
    map old = *m;
    map_init(m, old.cap);
    for (size_t i = 0; i < old.cap; i++)
        if (old.keys[i] != EMPTY) map_put(m, old.keys[i], old.vals[i]);
    free(old.keys);
    free(old.vals);
}

static void map_put(map *m, uint64_t key, int64_t val) {
    if ((m->n + 1) * 2 > m->cap) map_grow(m);
    size_t i = hash64(key) & (m->cap - 1);
    while (m->keys[i] != EMPTY && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    if (m->keys[i] == EMPTY) m->n++;
    m->keys[i] = key;
    m->vals[i] = val;
}

/* Deletion with backward-shift keeps linear probing correct without tombstones. */
static void map_del(map *m, uint64_t key) {
    size_t i = hash64(key) & (m->cap - 1);
    while (m->keys[i] != key) {
        if (m->keys[i] == EMPTY) return;
        i = (i + 1) & (m->cap - 1);
    }
    m->keys[i] = EMPTY;
    m->n--;
    for (size_t j = (i + 1) & (m->cap - 1); m->keys[j] != EMPTY; j = (j + 1) & (m->cap - 1)) {
        size_t home = hash64(m->keys[j]) & (m->cap - 1);
        /* move j back to i if its home is not in (i, j] cyclically */
        bool in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            m->keys[j] = EMPTY;
            i = j;
        }
    }
}

struct xcache {
    xc_policy policy;
    size_t capacity, used;
    slot *slots;
    size_t *heap; /* slot indices; heap[0] is the next victim */
    map where;    /* key -> slot */
    map freq;     /* key -> uses so far, kept after eviction (LFU) */
    map seen;     /* key -> (step << 1) | resident, for the step's first request */
    uint64_t tick;
    int32_t step;
    uint64_t *future_next; /* BELADY: next_use per request index */
    size_t future_n, pos;
    xc_stats st;
};

/* true when slot a should be evicted before slot b */
static bool before(const xcache *c, size_t a, size_t b) {
    const slot *x = &c->slots[a], *y = &c->slots[b];
    switch (c->policy) {
    case XC_LFU:
        /* ties evict the NEWEST entry: a decode step scans every layer in
         * order, a cyclic pattern larger than the cache, on which "evict the
         * oldest" keeps nothing; keeping the established set pins it. */
        if (x->freq != y->freq) return x->freq < y->freq;
        return x->last > y->last;
    case XC_BELADY:
        if (x->next != y->next) return x->next > y->next;
        return x->last < y->last;
    default:
        return x->last < y->last;
    }
}

static void heap_swap(xcache *c, size_t i, size_t j) {
    size_t t = c->heap[i];
    c->heap[i] = c->heap[j];
    c->heap[j] = t;
    c->slots[c->heap[i]].heap_pos = i;
    c->slots[c->heap[j]].heap_pos = j;
}

static void heap_fix(xcache *c, size_t i) {
    while (i > 0 && before(c, c->heap[i], c->heap[(i - 1) / 2])) {
        heap_swap(c, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < c->used && before(c, c->heap[l], c->heap[m])) m = l;
        if (r < c->used && before(c, c->heap[r], c->heap[m])) m = r;
        if (m == i) break;
        heap_swap(c, i, m);
        i = m;
    }
}

xcache *xc_new(xc_policy policy, size_t capacity) {
    xcache *c = xcalloc(1, sizeof *c);
    c->policy = policy;
    c->capacity = capacity;
    c->slots = xcalloc(capacity ? capacity : 1, sizeof *c->slots);
    c->heap = xcalloc(capacity ? capacity : 1, sizeof *c->heap);
    map_init(&c->where, capacity ? capacity : 1);
    map_init(&c->freq, 1024);
    map_init(&c->seen, 1024);
    return c;
}

void xc_free(xcache *c) {
    if (!c) return;
    free(c->slots);
    free(c->heap);
    free(c->where.keys); free(c->where.vals);
    free(c->freq.keys); free(c->freq.vals);
    free(c->seen.keys); free(c->seen.vals);
    free(c->future_next);
    free(c);
}

static uint64_t key_of(int32_t layer, int32_t expert) {
    return ((uint64_t)(uint32_t)layer << 32) | (uint32_t)expert;
}

void xc_set_future(xcache *c, const xc_request *reqs, size_t n) {
    free(c->future_next);
    c->future_next = xmalloc_array(n ? n : 1, sizeof *c->future_next);
    c->future_n = n;
    c->pos = 0;
    map last;
    map_init(&last, 1024);
    for (size_t i = n; i-- > 0;) {
        uint64_t k = key_of(reqs[i].layer, reqs[i].expert);
        int64_t *v = map_find(&last, k);
        c->future_next[i] = v ? (uint64_t)*v : UINT64_MAX;
        map_put(&last, k, (int64_t)i);
    }
    free(last.keys);
    free(last.vals);
}

void xc_begin_step(xcache *c) { c->step++; }

bool xc_request_one(xcache *c, int32_t layer, int32_t expert, bool *resident, int64_t *evicted) {
    uint64_t k = key_of(layer, expert);
    uint64_t next = UINT64_MAX;
    if (c->policy == XC_BELADY && c->future_next && c->pos < c->future_n) next = c->future_next[c->pos];
    c->pos++;
    c->tick++;
    c->st.requests++;
    if (evicted) *evicted = -1;
    /* A step fetches the union of its selections once: a repeat within the
     * step is served from that batch (a raw hit) and leaves the policy alone. */
    int64_t *sn = map_find(&c->seen, k);
    if (sn && (*sn >> 1) == c->step) {
        bool res = (*sn & 1) != 0;
        c->st.hits++;
        if (res) c->st.resident_hits++;
        if (resident) *resident = res;
        return true;
    }
    int64_t *f = map_find(&c->freq, k);
    uint64_t uses = f ? (uint64_t)*f + 1 : 1;
    map_put(&c->freq, k, (int64_t)uses);

    int64_t *w = map_find(&c->where, k);
    if (w) {
        slot *s = &c->slots[*w];
        s->last = c->tick;
        s->freq = uses;
        s->next = next;
        heap_fix(c, s->heap_pos);
        bool res = s->step_in < c->step;
        map_put(&c->seen, k, ((int64_t)c->step << 1) | res);
        c->st.hits++;
        if (res) c->st.resident_hits++;
        if (resident) *resident = res;
        return true;
    }
    c->st.misses++;
    map_put(&c->seen, k, (int64_t)c->step << 1);
    if (resident) *resident = false;
    if (c->capacity == 0) return false;
    size_t idx;
    if (c->used < c->capacity) {
        idx = c->used;
        c->heap[c->used] = idx;
        c->slots[idx].heap_pos = c->used;
        c->used++;
    } else {
        idx = c->heap[0];
        if (evicted) *evicted = (int64_t)c->slots[idx].key;
        map_del(&c->where, c->slots[idx].key);
        c->st.evictions++;
    }
    slot *s = &c->slots[idx];
    s->key = k;
    s->last = c->tick;
    s->freq = uses;
    s->next = next;
    s->step_in = c->step;
    map_put(&c->where, k, (int64_t)idx);
    heap_fix(c, s->heap_pos);
    return false;
}

xc_stats xc_get_stats(const xcache *c) { return c->st; }

const char *xc_policy_name(xc_policy p) {
    switch (p) {
    case XC_LFU: return "lfu";
    case XC_BELADY: return "belady";
    default: return "lru";
    }
}

xc_stats xc_simulate(const xc_request *reqs, size_t n, xc_policy policy, size_t capacity) {
    xcache *c = xc_new(policy, capacity);
    if (policy == XC_BELADY) xc_set_future(c, reqs, n);
    int32_t step = n ? reqs[0].step - 1 : 0;
    for (size_t i = 0; i < n; i++) {
        if (reqs[i].step != step) {
            xc_begin_step(c);
            step = reqs[i].step;
        }
        xc_request_one(c, reqs[i].layer, reqs[i].expert, NULL, NULL);
    }
    xc_stats st = xc_get_stats(c);
    xc_free(c);
    return st;
}

/* ---- traces ------------------------------------------------------------- */

static const char MAGIC[8] = {'K', '3', 'X', 'T', 'R', 'A', 'C', 'E'};

int xc_trace_read(const char *path, xc_request **reqs, size_t *n, k3_err *err) {
    char *data;
    size_t len;
    int rc = k3_read_file(path, &data, &len, err);
    if (rc) return rc;
    xc_request *out = NULL;
    size_t cnt = 0;
    if (len >= 16 && memcmp(data, MAGIC, 8) == 0) {
        uint32_t version;
        memcpy(&version, data + 8, 4);
        if (version != 1) {
            free(data);
            return k3_fail(err, K3_EXIT_USAGE, "%s: unsupported trace version %u", path, version);
        }
        if ((len - 16) % 12 != 0) {
            free(data);
            return k3_fail(err, K3_EXIT_USAGE, "%s: truncated trace (%zu bytes of records, not a multiple of 12)",
                           path, len - 16);
        }
        cnt = (len - 16) / 12;
        out = xmalloc_array(cnt ? cnt : 1, sizeof *out);
        for (size_t i = 0; i < cnt; i++) {
            int32_t r[3];
            memcpy(r, data + 16 + 12 * i, 12);
            out[i].step = r[0]; out[i].layer = r[1]; out[i].expert = r[2];
        }
    } else {
        /* peer format: int32 (layer, expert) pairs; a new step starts when the
         * layer index goes down (layers are visited in order within a step) */
        if (len % 8 != 0 || len == 0) {
            free(data);
            return k3_fail(err, K3_EXIT_USAGE,
                           "%s: not a k3 trace and not a (layer, expert) int32 pair trace (%zu bytes)", path, len);
        }
        cnt = len / 8;
        out = xmalloc_array(cnt, sizeof *out);
        int32_t step = 0, prev = -1;
        for (size_t i = 0; i < cnt; i++) {
            int32_t r[2];
            memcpy(r, data + 8 * i, 8);
            if (r[0] < 0 || r[1] < 0) {
                free(data); free(out);
                return k3_fail(err, K3_EXIT_USAGE, "%s: negative layer or expert in record %zu", path, i);
            }
            if (r[0] < prev) step++;
            prev = r[0];
            out[i].step = step; out[i].layer = r[0]; out[i].expert = r[1];
        }
    }
    free(data);
    *reqs = out;
    *n = cnt;
    return K3_OK;
}

int xc_trace_open(xc_trace_writer *w, const char *path, k3_err *err) {
    w->path = xstrdup(path);
    w->f = fopen(path, "wb");
    if (!w->f) {
        int e = errno;
        free(w->path);
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: cannot create trace: %s", path, strerror(e));
    }
    uint32_t hdr[2] = {1, 0};
    if (fwrite(MAGIC, 1, 8, w->f) != 8 || fwrite(hdr, 4, 2, w->f) != 2)
        return k3_fail(err, K3_EXIT_RUNTIME, "%s: write failed", path);
    return K3_OK;
}

int xc_trace_write(xc_trace_writer *w, int32_t step, int32_t layer, int32_t expert, k3_err *err) {
    int32_t r[3] = {step, layer, expert};
    if (fwrite(r, 4, 3, w->f) != 3) return k3_fail(err, K3_EXIT_RUNTIME, "%s: write failed", w->path);
    return K3_OK;
}

int xc_trace_close(xc_trace_writer *w, k3_err *err) {
    int rc = K3_OK;
    if (fclose(w->f) != 0) rc = k3_fail(err, K3_EXIT_RUNTIME, "%s: close failed", w->path);
    free(w->path);
    w->f = NULL;
    w->path = NULL;
    return rc;
}
