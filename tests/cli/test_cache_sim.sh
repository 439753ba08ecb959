# asan
# k3 cache-sim on the peer's real 93-layer expert trace.
. "$(dirname "$0")/lib.sh"
T=$(fixture peer/expert_trace.bin)
expect_exit sim_default 0 "$K3" cache-sim "$T"
expect_out_contains sim_default "100096 requests, 8 steps"
expect_exit sim_gb 0 "$K3" cache-sim "$T" --capacity-gb 6,36 --json
expect_out_contains sim_gb '"capacity_experts":341'
expect_exit sim_missing 2 "$K3" cache-sim "$OUT/nope.bin"
expect_exit sim_badcap 2 "$K3" cache-sim "$T" --capacity x
expect_exit sim_noarg 2 "$K3" cache-sim
finish
