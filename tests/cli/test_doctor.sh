# asan
# k3 doctor: machine report, storage measurement on a scratch file, errors.
. "$(dirname "$0")/lib.sh"
expect_exit doctor_plain 0 "$K3" doctor
expect_out_contains doctor_plain "memory"
mkdir -p "$OUT/model"
expect_exit doctor_dir 0 "$K3" doctor "$OUT/model" --seconds 0.2
expect_out_contains doctor_dir "MB/s at depth 16"
expect_out_contains doctor_dir "next: bin/k3 run"
if ls "$OUT/model"/.k3-doctor-* >/dev/null 2>&1; then fail scratch_removed; else pass scratch_removed; fi
expect_exit doctor_missing 2 "$K3" doctor "$OUT/nope"
expect_exit doctor_badsec 2 "$K3" doctor --seconds -1
finish
