#!/usr/bin/env bash
# The streamer's GPU check in one command (device machine): the CUDA tests, then GPT-J-6B-shaped fp16
# (12.1 GB) streamed with ring_gb=1, gpu_gb=2 from a warm page cache, alternating this tree's streamer
# with the one in $OLD (a copy of an earlier commit's tiered/ and benchmarks/, if present), so that
# the two are compared side by side on one machine. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tiered-out}; mkdir -p "$OUT"
CACHE=${TIERED_CACHE:-/tmp/tiered-cache}; mkdir -p "$CACHE"
OLD=${OLD:-.old}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
$PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | grep -v "Loading weights\|Writing model" \
  | tee "$OUT/pytest_cuda.txt" | tail -15
G="$CACHE/gptj-6b-fp16"
$PY benchmarks/make_checkpoint.py --arch gptj-6b --dtype fp16 --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null  # warm the page cache
R="$OUT/gptj_side_by_side.jsonl"
for i in 1 2 3; do
  for who in new old; do
    if [ "$who" = new ]; then S=benchmarks/stream_run.py; else S="$OLD/benchmarks/stream_run.py"; fi
    [ -f "$S" ] || continue
    $PY "$S" "$G" --out "$R" --label "$who-warm-t4-$i" --ring-gb 1 --gpu-gb 2 --new-tokens 8 --threads 4 2>&1 \
      | grep -v "Loading weights" | tail -1
  done
done
