#!/usr/bin/env bash
# The whole GPU check in one go (device machine, as root): equality vs stock transformers on the
# GPU, then a GPT-J-6B-shaped fp16 checkpoint (12.1 GB) streamed with ring_gb=1 — warm and cold
# page cache — and loaded resident. Results (JSON lines + logs) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tiered-out}; mkdir -p "$OUT"
CACHE=${TIERED_CACHE:-/tmp/tiered-cache}; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; df -h "$CACHE" | tail -1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
if [ "${SKIP_EQ:-0}" != 1 ]; then
  $PY benchmarks/gpu_equality.py --out "$OUT/gpu_equality.json" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu_equality.log"
fi
G="$CACHE/gptj-6b-fp16"
$PY benchmarks/make_checkpoint.py --arch gptj-6b --dtype fp16 --quiet "$G" 2>&1 | tail -2
R="$OUT/gptj.jsonl"
run() { $PY benchmarks/stream_run.py "$G" --out "$R" "$@" 2>&1 | grep -v "Loading weights" | tail -3; }
run --label streamed-warm-t8 --ring-gb 1 --gpu-gb 2 --new-tokens 8 --threads 8
run --label streamed-warm-t4 --ring-gb 1 --gpu-gb 2 --new-tokens 8 --threads 4
run --label streamed-cold-t8 --ring-gb 1 --gpu-gb 2 --new-tokens 3 --threads 8 --drop-caches
run --label resident-warm --ring-gb 1 --new-tokens 16 --threads 8
