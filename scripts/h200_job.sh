#!/usr/bin/env bash
# One device call: fixtures (CPU, seconds) + tiny-model training (GPU, <= --max-seconds) and packing.
#
#   bash scripts/h200_job.sh            (from the repo root, with .corpus/ carried; no network needed)
#
# Logs go to $OUT/fixtures.log, $OUT/check.log, $OUT/train.log (or /tmp/h200_job/ when OUT is unset);
# the produced files (assets/*, tests/fixtures/**, tests/data/heldout.txt) are packed into
# $OUT/artifacts.tar, to be unpacked at the repo root: `tar xf artifacts.tar`.
# MAX_SECONDS (default 330) is the budget handed to train_tiny.py; TRAIN_ARGS adds arguments
# (e.g. TRAIN_ARGS=--smoke for a local CPU test of the whole job).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export USE_HUB_KERNELS=0 HF_HUB_OFFLINE=1
LOGDIR="${OUT:-/tmp/h200_job}"
mkdir -p "$LOGDIR"
status=0
t0=$(date +%s)

echo "== $(date -u +%FT%TZ) $(hostname) python $(python3 --version 2>&1)" | tee "$LOGDIR/fixtures.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOGDIR/fixtures.log"

if [ ! -f .corpus/fortunes.txt ]; then
    echo "ERROR: .corpus/fortunes.txt missing (run scripts/fetch_corpus.sh here and carry .corpus)" | tee -a "$LOGDIR/train.log"
    status=1
fi

python3 scripts/make_fixtures.py --out tests/fixtures 2>&1 | tee -a "$LOGDIR/fixtures.log" || status=1
# Independent f64 check of the fixtures (numpy); informative only.
python3 scripts/check_fixtures.py tests/fixtures 2>&1 | tee "$LOGDIR/check.log" || true

if [ -f .corpus/fortunes.txt ]; then
    python3 scripts/train_tiny.py --out assets --max-seconds "${MAX_SECONDS:-330}" ${TRAIN_ARGS:-} 2>&1 | tee "$LOGDIR/train.log" || status=1
fi

files=()
for f in assets tests/fixtures tests/data/heldout.txt; do [ -e "$f" ] && files+=("$f"); done
if [ -n "${OUT:-}" ] && [ ${#files[@]} -gt 0 ]; then
    tar cf "$OUT/artifacts.tar" "${files[@]}"
    tar tvf "$OUT/artifacts.tar"
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
