#!/usr/bin/env bash
# Embedding rows on the GPU machine, in one command: the CUDA tests and tests/test_rows.py, then
# GPT-J-6B-shaped fp16 (12.1 GB) streamed with ring_gb=1, gpu_gb=2 from a warm page cache, alternating
# embedding rows on (default) and off (--no-embedding-rows: the embedding streams whole, as before),
# three times each, side by side. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tiered-out}; mkdir -p "$OUT"
CACHE=${TIERED_CACHE:-/tmp/tiered-cache}; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
$PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$OUT/pytest_cuda.txt" | tail -15
$PY -m pytest -q tests/test_rows.py -p no:cacheprovider 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$OUT/pytest_rows_cli.txt" | tail -5
G="$CACHE/gptj-6b-fp16"
$PY benchmarks/make_checkpoint.py --arch gptj-6b --dtype fp16 --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null  # warm the page cache
R="$OUT/gptj_rows_side_by_side.jsonl"
for i in 1 2 3; do
  for mode in rows whole; do
    extra=""; [ "$mode" = whole ] && extra="--no-embedding-rows"
    $PY benchmarks/stream_run.py "$G" --out "$R" --label "$mode-warm-$i" --ring-gb 1 --gpu-gb 2 --new-tokens 8 \
      --threads 4 $extra 2>&1 | grep -v "Loading weights" | tail -1
  done
done
