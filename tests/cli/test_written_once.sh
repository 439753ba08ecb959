#!/usr/bin/env bash
# Written once: a grep-level check that what the engine has one of stays one.
# Each check names the functions it looks for; a failure names the file and
# line of the second copy. (Source text only: no binary runs here.)
. "$(dirname "$0")/lib.sh"

# hits PATTERN FILES...: the matching lines, "file:line: text", comments left out
hits() {
  local pat=$1; shift
  grep -nHE "$pat" "$@" 2>/dev/null | grep -vE '^[^:]+:[0-9]+:[[:space:]]*(/?\*|//)' || true
}
# once NAME PATTERN ALLOWED_FILES_REGEX FILES...: every hit lies in an allowed file
once() {
  local name=$1 pat=$2 allow=$3; shift 3
  local bad
  bad=$(hits "$pat" "$@" | grep -vE "^($allow):" || true)
  if [ -z "$bad" ]; then pass "$name"; else fail "$name" "$(echo "$bad" | head -3 | tr '\n' ' ')"; fi
}
SRC=$(find src -name '*.c' -o -name '*.h' | sort)

# ---- one layer forward: the decoder layer and the model stitching --------------
# The layer graph (layer_forward, graph_forward in src/model/model.c) is the
# only caller of the blocks' forwards; k3 run, batched decoding and k3 train all
# reach the blocks through it (k3_forward, k3_forward_batch, k3_forward_rec).
# A second layer loop would call these from somewhere else.
BLOCK_FWD='\b(kda_block|mla_block|moe_block|mlp_block|layer_forward|graph_forward|k3_kda_rec_forward|k3_mla_rec_forward|k3_moe_rec_forward|k3_mlp_rec_forward|k3_attnres_rows|k3_attnres|k3_layer|k3_kda|k3_mla|k3_moe|k3_mlp)\('
once layer-forward:callers "$BLOCK_FWD" 'src/model/[a-z_]+\.[ch]' $SRC
once layer-forward:defined-once '^(static )?int (layer_forward|graph_forward)\(' 'src/model/model\.c' $SRC
# the model-level stitching: the embedding gather and the head product of a
# forward live in graph_forward; training has no row copy of the embedding
once stitching:embedding 'm->embed *\+|w *\+ *m->embed' 'src/train/(optim|ckpt|export)\.c' $(find src/train -name '*.c')

# ---- one binding: the model's binder, no hand-built weight views ----------------
# A weight view is a k3_mat (or a block's weight struct) filled by hand; the
# trainer binds its parameters with k3_bind_layer / k3_model_open_lookup over
# tm_lookup (src/model/weights.c), which is the only place views are made from
# tensors.
once binding:no-mat-literals '\(k3_mat\) *\{|\.type *= *KW_F32|\(k3_(kda|mla|moe|mlp|expert)_w\) *\{' 'src/kernels/[a-z_0-9]+\.[ch]|src/model/mla\.c|src/memory/[a-z_]+\.c' $(find src/train src/model src/memory src/cli src/engine -name '*.c')
once binding:no-view-functions '\b(kda_view|mla_view|mlp_view|moe_view)\(' '' $SRC

# ---- one MLA core per form ----------------------------------------------------
# The absorbed core (decode: core_absorbed) and the expanded one (prefill and
# training: k3_mla_attend_expanded, whose BF16 form for training runs its two
# products as GEMMs in the same loop) are defined in src/model/mla.c, and the
# expanded core's causal softmax (causal_softmax_row) is private to that file.
# Another definition, or a causal softmax outside it (a row normalised over
# s <= t, i.e. a second core), fails.
once mla-core:defined '^(K3_HOT )?(static )?void (core_absorbed|k3_mla_attend_expanded)\(' 'src/model/mla\.c' $(find src -name '*.c')
once mla-core:softmax-private 'causal_softmax_row\(' 'src/model/mla\.c' $SRC
once mla-core:no-bf16-forward '\battn_fwd_bf16\b|t_mla_attend' '' $SRC

# ---- the graph on top of its blocks ----------------------------------------------
# kda.c, mla.c and moe.c call nothing model.c defines (what they share is
# common.c's): no circle between the graph and its blocks.
defs=$(grep -oE '^(K3_HOT )?[a-z][a-z0-9_ *]* \**(k3_[a-z0-9_]+)\(' src/model/model.c | grep -oE 'k3_[a-z0-9_]+\($' | sed 's/($//' | sort -u)
bad=
for f in $defs; do hits "\\b$f\\(" src/model/kda.c src/model/mla.c src/model/moe.c | grep -q . && bad="$bad $f"; done
[ -n "$defs" ] && [ -z "$bad" ] && pass model:graph-on-top || fail model:graph-on-top "blocks call model.c's:$bad (defs: $(echo $defs | head -c 80))"

# ---- --layers, the layer counts, the workspace: each in one place ---------------
# --layers is applied by the engine (the config it plans with) and by the
# model's option step (apply_opts, weights.c), once each; the layer-kind
# counts are derived only in formats/config.c's count_kinds; every block
# defines its workspace need in its own file, beside its ws_get calls.
n=$(hits 'k3_config_first_layers\(' src/engine/engine.c | wc -l); m=$(hits 'k3_config_first_layers\(' src/model/weights.c | wc -l)
once layers:applied 'k3_config_first_layers\(' 'src/engine/engine\.c|src/model/weights\.c|src/formats/config\.[ch]' $SRC
[ "$n" -eq 1 ] && [ "$m" -eq 1 ] && pass layers:once-per-route || fail layers:once-per-route "engine.c $n, weights.c $m calls"
once layers:kind-counts 'n_(kda|mla)_layers(\+\+| *\+=| *= *0)' 'src/formats/config\.c' $SRC
n=$(hits 'n_kda_layers\+\+' src/formats/config.c | wc -l)
[ "$n" -eq 1 ] && pass layers:counted-once || fail layers:counted-once "$n counting loops in config.c"
for b in kda mla moe; do
  hits "^size_t ${b}_ws_need\(" src/model/$b.c | grep -q . && pass "workspace:$b-beside-block" || fail "workspace:$b-beside-block" "no ${b}_ws_need in src/model/$b.c"
done

# ---- one generation loop ------------------------------------------------------
# The loop that checks logits, samples, stops and feeds is k3_generate
# (src/generate/generate.c); k3 run, k3 chat, k3 serve and the trainer's
# samples pass it callbacks. A second loop would call the sampler
# (k3_sample) or the logits check (k3_logits_check) itself: both are allowed
# only there and in the sampler's own file (src/model/model.c, model.h).
once generation:sample 'k3_sample\(' 'src/generate/generate\.[ch]|src/model/model\.[ch]' $SRC
once generation:logits-check 'k3_logits_check\(' 'src/generate/generate\.[ch]|src/model/model\.[ch]' $SRC

# ---- a closed engine ----------------------------------------------------------
# k3_engine is opaque: its definition lives in src/engine/engine.c and every
# caller goes through engine.h's accessors and operations.
once engine:opaque '^(typedef )?struct k3_engine *\{' 'src/engine/engine\.c' $SRC
# Only the engine and a session feed the model for inference (k3_forward,
# k3_forward_batch): a command that called them would go around the plan's
# run report and the ranks' exchanges. The trainer's check (export.c
# compares the exported model's logits) is allowed by name.
once engine:forward-callers '\bk3_forward(_batch)?\(' \
  'src/model/[a-z_]+\.[ch]|src/engine/engine\.c|src/session/session\.c|src/train/export\.c' $SRC
# k3 run parses flags, opens the engine, generates and reports: no memory
# plan, no ranks, no forward, no state and no model of its own. k3 chat
# alike: its input reaches the ranks through the engine (k3_engine_getline,
# k3_engine_agree).
RUN_OWN='\b(k3_runmem_[a-z_]+|k3_dist_[a-z_]+|k3_forward[a-z_]*|k3_state_new|k3_model_open[a-z_]*)\('
once engine:run-goes-through "$RUN_OWN" '' src/cli/cmd_run.c
once engine:chat-goes-through "$RUN_OWN" '' src/cli/cmd_chat.c
# No command includes the engine's own parts (the placement, the split trunk,
# the model's binder interface).
once engine:cli-includes '#include "(dist/(expert_par|tensor_par)|model/model_impl)\.h"' 'src/cli/cmd_cache_sim\.c' \
  $(find src/cli -name '*.c' -o -name '*.h')
# The checkpoint's identity is computed in src/formats from the open index;
# data flows session -> engine -> model, so the engine includes no session,
# generation, serve or command header.
once engine:identity-in-formats '^int k3_model_identity(_of)?\(' 'src/formats/identity\.[ch]' $SRC
once engine:no-upward-include '#include "(session|generate|serve|cli|draft)/' '' src/engine/engine.c src/engine/engine.h

# ---- one public header per module -----------------------------------------------
# A module's private headers (internal.h, *internal.h, *_impl.h, and the old
# kernels/kmath.h) are the seams between its own files; other modules see it
# only through its public header. Allowed outside src/MOD: the white-box unit
# tests and benchmarks named for the module (tests/test_MOD.c,
# tests/test_MOD_*.c, bench/MOD.c) and the kernels' product benchmark
# (bench/gemm.c times the SIMD tiles).
private_includes() {
  local f mod bad=""
  while IFS= read -r hit; do
    f=${hit%%:*}
    mod=$(echo "$hit" | sed -E 's/.*#include "([a-z_0-9]+)\/.*/\1/')
    case $f in
      src/$mod/*) continue ;;
      tests/test_$mod.c | tests/test_${mod}_*.c | bench/$mod.c) continue ;;
    esac
    [ "$mod/$f" = kernels/bench/gemm.c ] && continue
    bad="$bad$hit"$'\n'
  done < <(hits '#include "[a-z_0-9]+/[a-z_0-9]*(internal|_impl|kmath)\.h"' \
             $(find src tests bench -name '*.c' -o -name '*.h' | sort))
  if [ -z "$bad" ]; then pass modules:private-headers; else fail modules:private-headers "$(echo "$bad" | head -3 | cut -c1-120 | tr '\n' ' ')"; fi
}
private_includes
# The model's headers by audience: model.h for users of a model; what plugs
# into it (model/source.h) only for the modules that plug in (the streaming
# source, the ranks' sources and products, the trainer's lookup) and the
# engine that sets them; the blocks and training records (model/records.h)
# only for training. bench/layers.c, which binds one layer through the binder
# and times each block alone, needs both; tests/test_stream.c feeds the MoE
# block alone from the streaming source (the experts-only source bench/layers.c
# reads from disk) and so needs the blocks. The commands, sessions, generation
# and serving see model.h alone.
MODEL_HDRS=$(find src tests bench -name '*.c' -o -name '*.h' | sort)
once model:source-includers '#include "model/source\.h"' \
  'src/(model|memory|dist|train)/[a-z_]+\.[ch]|src/engine/engine\.c|tests/test_model\.c|bench/decode\.c|bench/layers\.c' $MODEL_HDRS
once model:records-includers '#include "model/records\.h"' \
  'src/(model|train)/[a-z_]+\.[ch]|tests/test_model\.c|tests/test_stream\.c|tests/test_train_[a-z_]+\.c|tests/test_train\.c|bench/layers\.c' $MODEL_HDRS

# ---- no hidden globals in training ------------------------------------------------
# What the trainer computes with travels in its structs: the GEMM mode is
# tmodel.bf16, passed to each product (tm_gemm_mode, t_fwd_ops(mode)); the
# lookup's name buffer is its context's (tm_lookup_ctx). An object of static
# storage that can change (not const; a pointer counts as const only when it
# is `* const`) is a hidden global, file-scope or inside a function, static,
# extern or thread-local; the one allowed is the stop flag a signal handler
# sets (a volatile sig_atomic_t, which a handler can reach only as a global).
hidden_globals() {
  local hit text decl bad=""
  while IFS= read -r hit; do
    [ -n "$hit" ] || continue
    text=${hit#*:*:}
    decl=${text%%=*}
    # a function (its name, then its parameters), a type, a declared tag
    echo "$decl" | grep -qE '[A-Za-z_0-9]\(|^[[:space:]]*(typedef|enum)\b|^[[:space:]]*(struct|union)[[:space:]]+[A-Za-z_0-9]+;' && continue
    case $decl in *"volatile sig_atomic_t"*) continue ;; esac
    if echo "$decl" | grep -qw const && ! echo "$decl" | sed -E 's/\*[[:space:]]*const\b//g' | grep -q '\*'; then
      continue
    fi
    bad="$bad$hit"$'\n'
  done < <(hits '^[[:space:]]*(static|extern|_Thread_local|__thread)[[:space:]]|^[A-Za-z_][A-Za-z_0-9]*[[:space:]][^(=;]*(=|;)|\b(_Thread_local|__thread)\b' \
             $(find src/train -name '*.c' -o -name '*.h' | sort))
  if [ -z "$bad" ]; then pass train:no-hidden-globals; else fail train:no-hidden-globals "$(echo "$bad" | head -3 | cut -c1-120 | tr '\n' ' ')"; fi
}
hidden_globals

# ---- the kernels' names -------------------------------------------------------------
# The training GEMM lives in src/kernels under the kernels' prefix (k_gemm,
# k_gemm_sym, k_view, k_gemm_mode with K_GEMM_F32 / K_GEMM_BF16, k_gemm_amx,
# k_gemm_set_scalar ...): the training prefix tg_ in kernels.h or beside it
# would name a kernel after one of its callers.
once names:kernels-prefix '\b(tg|TG)_[A-Za-z_0-9]+' '' $(find src/kernels -name '*.c' -o -name '*.h' | sort)

finish
