#!/usr/bin/env bash
# Several GPUs (issue 11), in one command on a machine with >= 2 GPUs (device kind nvidia-h200-x2):
# the CUDA tests (incl. two ranks under torchrun, bitwise against stock), tests/test_dist.py (gloo),
# the ceilings (pinned H2D per GPU alone and all GPUs at once, NCCL all-gather), then GPT-J-6B-shaped
# fp16 (12.1 GB) streamed with ring_gb=1, gpu_gb=2 from a warm page cache, alternating one GPU
# (N=1, plain tiered.load) and two ranks under torchrun (N=2, distributed=True), three times each.
# Results go to $OUT. `gpu_dist_check.sh tests` runs the first half (tests, ceilings, checkpoint),
# `gpu_dist_check.sh bench` the second (the side-by-side runs); no argument runs both.
set -uo pipefail
PHASE=${1:-all}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tiered-out}; mkdir -p "$OUT"
CACHE=${TIERED_CACHE:-/tmp/tiered-cache}; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
N=${NGPU:-$(nvidia-smi -L | wc -l)}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
nproc >> "$OUT/machine.txt"; free -g >> "$OUT/machine.txt"
if [ "$PHASE" != bench ]; then
$PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$OUT/pytest_cuda.txt" | tail -8
$PY -m pytest -q tests/test_dist.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_dist.txt" | tail -3
fi
G="$CACHE/gptj-6b-fp16"
$PY benchmarks/make_checkpoint.py --arch gptj-6b --dtype fp16 --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null  # warm the page cache
$PY -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/dist_ceilings.py --model-dir "$G" 2>&1 \
  | grep '^{' | tee -a "$OUT/dist_ceilings.json"
[ "$PHASE" = tests ] && exit 0
R="$OUT/gptj_dist_side_by_side.jsonl"
# configurations "io:threads:host_gb" (host_gb: the pinned host tier, GiB per rank; 0: none)
CONFIGS=${CONFIGS:-"mmap:4:0 pread:16:0 mmap:4:11"}
for i in $(seq 1 "${REPS:-2}"); do
  for c in $CONFIGS; do
    IFS=: read -r io t hg <<< "$c"
    $PY benchmarks/stream_run.py "$G" --out "$R" --label "n1-$io-t$t-h$hg-$i" --ring-gb 1 --gpu-gb 2 --new-tokens 8 \
      --io "$io" --threads "$t" --host-gb "$hg" 2>&1 | grep '^{' | tail -1 | cut -c1-200
    $PY -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/stream_run.py "$G" --out "$R" \
      --label "n$N-$io-t$t-h$hg-$i" --distributed --ring-gb 1 --gpu-gb 2 --new-tokens 8 --io "$io" --threads "$t" \
      --host-gb "$hg" 2>&1 | grep '^{' | cut -c1-200
  done
done
