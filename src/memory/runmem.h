/* runmem.h: what `k3 run` calls to run inside a memory budget (a model may
 * be larger than the memory: layers and experts are then streamed).
 *
 * The command keeps its own flow; this module adds, in call order:
 *   k3_runmem_parse    the budget flags (--trunk, --preset, --trunk-gb,
 *                      --cache-gb, --chunk, --cache-policy, --dump-cache-trace,
 *                      --list-presets; a later budget flag wins)
 *   k3_runmem_begin    config + shard index (as the engine read them, once)
 *                      -> memory plan; a plan that cannot fit is refused
 *                      (exit 3, one line) before any weight byte is read
 *   k3_runmem_attach   after k3_model_open(top_only): the streaming source
 *   k3_runmem_print_plan  before the first forward call (printed late so that
 *                      an error while opening stays a single line)
 *   k3_runmem_step     after each forward call: one report line
 *   k3_runmem_summary / k3_runmem_json   the run report
 *   k3_runmem_free     after k3_model_free */
#ifndef K3_MEMORY_RUNMEM_H
#define K3_MEMORY_RUNMEM_H

#include <jansson.h>

#include "memory/budget.h"
#include "memory/stream.h"

typedef struct {
    k3_stream_opts so;
    k3_budget budget;
    bool budget_given;     /* any of --preset/--trunk-gb/--cache-gb */
    bool list_presets;
} k3_runmem_args;

void k3_runmem_args_init(k3_runmem_args *a);
/* If argv[*i] is one of the flags above, consumes it (and its value, moving
 * *i) and sets *used; usage errors return K3_EXIT_USAGE with err filled. */
/* cmd: the command the errors name ("run", "serve", ...). */
int k3_runmem_parse(k3_runmem_args *a, const char *cmd, int argc, char **argv, int *i, bool *used, k3_err *err);
/* Help lines for the flags (a string literal, to splice into the command's help). */
#define K3_RUNMEM_HELP \
    "memory (the output ids are the same at every budget):\n" \
    "  --preset NAME        laptop, desktop, workstation, server, max or auto\n" \
    "                       (default auto: 85% of MemAvailable or of a memory\n" \
    "                       cgroup limit's headroom if less, trunk first)\n" \
    "  --trunk-gb GB        memory for the dense trunk: model-level tensors,\n" \
    "                       resident or pinned layers and ring slots\n" \
    "  --cache-gb GB        memory for routed experts: the cache plus the buffers\n" \
    "                       of one batch (a later budget flag wins)\n" \
    "  --list-presets       print the preset table and exit\n" \
    "  --trunk DIR          stream the trunk from a packed trunk (k3 pack-trunk):\n" \
    "                       a prefix of layers that fits --trunk-gb stays pinned,\n" \
    "                       the rest is read through ring slots (O_DIRECT), the\n" \
    "                       next layer while the current one computes; without\n" \
    "                       --trunk the trunk is mapped resident from the shards\n" \
    "  --chunk C            prefill C tokens per forward call, each selected expert\n" \
    "                       read once per chunk (default 256, lowered to what the\n" \
    "                       memory budget holds)\n" \
    "  --cache-policy P     lfu (default) or lru\n" \
    "  --dump-cache-trace DIR   write DIR/cache_trace.bin, every expert request\n" \
    "                       (step, layer, expert), for 'k3 cache-sim'\n"

typedef struct k3_runmem k3_runmem;
/* cfg: the config as the run sees it (k3_config_first_layers applied for
 * --layers; copied); ix: the shards' index (a reference is taken, st_retain;
 * the caller keeps its own); max_pos: positions the run may hold (an upper
 * bound is fine); mem_limit: refuse plans above it (0: MemAvailable). */
int k3_runmem_begin(const k3_runmem_args *a, const k3_config *cfg, st_index *ix, int64_t max_pos, uint64_t mem_limit,
                    k3_runmem **out, k3_err *err);
void k3_runmem_print_plan(const k3_runmem *rm, FILE *f);
/* Model opened with k3_model_opts.top_only. */
int k3_runmem_attach(k3_runmem *rm, k3_model *m, k3_err *err);
/* Tokens per prefill call the plan holds. */
int k3_runmem_chunk(const k3_runmem *rm);
/* Lowers the plan's prefill chunk to at most chunk (before attach): the ranks
 * of an expert-parallel job must feed the same chunks. Only shrinks memory. */
void k3_runmem_limit_chunk(k3_runmem *rm, int chunk);
/* The weight source attached to the model (NULL before attach). */
const k3_weight_source *k3_runmem_source(k3_runmem *rm);
/* Records one forward call of ntokens (a prefill chunk or a decoded token)
 * and prints its line on f (NULL: record only). */
void k3_runmem_step(k3_runmem *rm, bool prefill, int ntokens, FILE *f);
void k3_runmem_summary(const k3_runmem *rm, FILE *f);
/* The weight bytes the decode forward calls (those recorded with prefill
 * false: decoded tokens and verifying passes) read, summed from the step
 * records. disk: bytes read from disk (streamed trunk layers, expert cache
 * misses: the stream's counters). touched: bytes read from disk or RAM: every
 * call reads the whole trunk (each layer's trunk tensors and the head, once
 * per call however many tokens it feeds) and each distinct expert it
 * requests (one expert counted at the plan's expert buffer, the largest
 * expert). A pass of T tokens costs one call, so fewer calls per generated
 * token read fewer bytes per token. */
typedef struct {
    uint64_t calls, requests, disk, touched;
} k3_runmem_reads;
k3_runmem_reads k3_runmem_decode_reads(const k3_runmem *rm);
/* Bytes of streamed trunk layers read from disk so far (0: trunk resident). */
uint64_t k3_runmem_trunk_read(const k3_runmem *rm);
/* Adds "memory": {plan, summary, steps[]} to a run's JSON report. */
void k3_runmem_json(const k3_runmem *rm, json_t *o);
void k3_runmem_free(k3_runmem *rm);

#endif
