#!/usr/bin/env bash
# HearthNet's GPU checks on a machine with a CUDA GPU and no network (after
# scripts/gpu_prepare.sh here): the CUDA tests, then the 3B shape's mesh against the local
# engine. Writes run.log, cuda-tests.log and the benchmarks' JSON into $OUT (default
# ./gpu-out). About 5 minutes on an H100; each step under its own timeout.
#
#   bash scripts/gpu_checks.sh                 tests, bench pipeline (1 2 4 chats)
#   SKIP_TESTS=1 bash scripts/gpu_checks.sh    the benchmarks only
#   EXTRA=spec bash scripts/gpu_checks.sh      also bench pipeline --speculate off lookup
#   EXTRA=noprefix bash scripts/gpu_checks.sh  also 2 and 4 chats without prefix sharing
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HEARTHNET_DATA_DIR=${HEARTHNET_DATA_DIR:-/tmp/hn} \
    HEARTHNET_TEST_TOKENIZER=$PWD/.gpu/tok PYTHONUNBUFFERED=1
L=$OUT/run.log
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} > "$L" 2>&1
# the synthetic 3B shape (random bf16 weights, seed 0) is written while the tests run
python3 - >> "$L" 2>&1 <<'PY' &
import time
from pathlib import Path
from hearthnet.models import ModelStore
from hearthnet.models.synth import shape_config, write_synthetic
t0 = time.perf_counter()
_, config = shape_config("qwen2.5-3b")
write_synthetic(ModelStore(), "qwen2.5-3b", config, model_id="hearthnet-synthetic/qwen2.5-3b",
                seed=0, tokenizer_from=Path(".gpu/tok"), source="synth:qwen2.5-3b:seed=0")
print(f"synthetic qwen2.5-3b written in {time.perf_counter() - t0:.1f} s")
PY
SYN=$!
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 200 python3 -m pytest -m cuda tests/cuda -q -rA -p no:cacheprovider > "$OUT/cuda-tests.log" 2>&1
    echo "pytest rc=$?" >> "$L"
    tail -3 "$OUT/cuda-tests.log"
fi
wait $SYN
echo "synth rc=$?" >> "$L"
bench() {  # $1 = name, then bench pipeline's arguments
    local name=$1; shift
    date -u >> "$L"
    timeout 240 python3 -m hearthnet.cli bench pipeline --device cuda --dtype bf16 --wire bf16 \
        --model qwen2.5-3b --tokens 64 "$@" --json --output "$OUT/$name.json" 2>&1 \
        | grep -v '^ \|^{\|^}' >> "$L"
    echo "$name rc=${PIPESTATUS[0]}" >> "$L"
}
bench pipeline --no-fp32 --runs 3 --concurrency 1 2 4
case "${EXTRA:-}" in
    *spec*) bench spec --runs 3 --speculate off lookup ;;
esac
case "${EXTRA:-}" in
    *noprefix*) bench noprefix --runs 2 --concurrency 2 4 --concurrency-only --no-prefix-sharing ;;
esac
date -u >> "$L"
cat "$L"
