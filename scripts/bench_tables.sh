#!/usr/bin/env bash
# The device runs behind BENCHMARKS.md's per-issue tables, in parts that each fit one device
# call (10 minutes). Every part starts with a throw-away bench (a cold GPU's first figures
# are nonsense) and appends to $OUT/bench_tables.txt (or /tmp/bench_tables.txt).
#
#   bash scripts/bench_tables.sh moe      # issue 10: the three MoE presets, q8_0 and f16, decode at 1k/32k and prefill 512/4096, split
#   bash scripts/bench_tables.sh formats  # issue 12: 130m, 2.7b, Codestral in f16, q8_0, q6_k, q4_k, split and GB/s
#   bash scripts/bench_tables.sh batch    # issue 13: 130m and Codestral q8_0 at 1, 4, 16, 64 lanes
#
# MAMBA2 names the binary (default target/release/mamba2; on the device .dev/mamba2 after
# ../shared/gpu/prepare.sh). Granite-4.0-H-Small in f16 needs ~70 GB: on an 80 GB card it may
# not fit, and the part says so and goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
B="${MAMBA2:-target/release/mamba2}"
O="${OUT:-/tmp}/bench_tables.txt"
export MAMBA2_REQUIRE_GPU=1
run() { echo "##### $*" >> "$O"; ( timeout 280 "$@" ) >> "$O" 2>&1; echo "rc=$?" >> "$O"; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1; } >> "$O"
run "$B" bench --config 130m --dtype q8_0 --tokens 50 --profile-tokens 0
case "${1:-}" in
moe)
    for c in nemotron-3-nano-30b-a3b granite-4.0-h-tiny granite-4.0-h-small; do
        for d in q8_0 f16; do
            run "$B" bench --config "$c" --dtype "$d" --ctx 1024,32768 --tokens 100 \
                --profile-tokens 10 --prefill 512,4096 --prefill-runs 1
        done
    done
    ;;
formats)
    for c in 130m 2.7b codestral-7b; do
        run "$B" bench --config "$c" --dtype f16,q8_0,q6_k,q4_k --tokens 150 --profile-tokens 20
    done
    ;;
batch)
    for c in 130m codestral-7b; do
        run "$B" bench --config "$c" --dtype q8_0 --no-decode --tokens 32 --warmup 4 \
            --prefill-runs 2 --batch 1,4,16,64
    done
    ;;
*)
    echo "usage: $0 moe|formats|batch" >&2
    exit 2
    ;;
esac
echo "##### done" >> "$O"
