#!/usr/bin/env bash
# The GPU expert cache (issue 8, capability 4) and the Llama-3-70B shape's RSS against a warmed CUDA runtime,
# in one command: the CUDA tests; then a Mixtral-8x7B-shaped bf16 checkpoint (6 layers, 17.9 GB) from a warm
# page cache, ring_gb=6: routed and dense streaming at gpu_gb=2 (no room for a cache) and at gpu_gb=10 (routed:
# the experts cache takes what the dense part leaves, "layer" policy and LRU), alternating; then the Llama-3-70B
# shape (6 layers) with ring_gb=1 after --cuda-warmup. Results go to $OUT.
# Last, compiled decoding with a static cache against eager (benchmarks/compile_check.py, TinyLlama shape).
#   MIXTRAL_LAYERS=6 L70=6 REPS=1 SKIP_TESTS=0 SKIP_COMPILE=0 bash benchmarks/gpu_cache_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
ML=${MIXTRAL_LAYERS:-6}
make_warm mixtral-8x7b "$ML"
R="$OUT/moe_cache.jsonl"
run() {  # label, then stream_run flags
  local label=$1; shift
  timeout 300 $PY benchmarks/stream_run.py "$G" --out "$R" --label "$label" --ring-gb 6 --new-tokens 16 --threads 4 "$@" \
    2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-200
}
for i in $(seq 1 "${REPS:-1}"); do
  run "mixtral-routed-gpu2-$i" --gpu-gb 2
  run "mixtral-dense-gpu2-$i" --gpu-gb 2 --no-routed-experts
  run "mixtral-routed-gpu10-layer-$i" --gpu-gb 10
  run "mixtral-routed-gpu10-lru-$i" --gpu-gb 10 --expert-cache-policy lru
  run "mixtral-routed-gpu10-nocache-$i" --gpu-gb 10 --expert-cache-gb 0
  run "mixtral-dense-gpu10-$i" --gpu-gb 10 --no-routed-experts
done
rm -rf "$G"  # disk room for the next one
L=${L70:-6}
make_warm llama3-70b "$L"
timeout 300 $PY benchmarks/stream_run.py "$G" --out "$OUT/big_units_warm.jsonl" --label "llama70-L$L-ring1-gpu0-warmup" \
  --ring-gb 1 --gpu-gb 0 --new-tokens 8 --cuda-warmup 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-200
rm -rf "$G"
[ "${SKIP_COMPILE:-0}" = 1 ] && exit 0
# compiled decoding (static cache) against eager on a streamed TinyLlama-shaped model
G="$CACHE/tinyllama-bf16"
$PY benchmarks/make_checkpoint.py --arch tinyllama-1.1b --dtype bf16 --quiet "$G" 2>&1 | tail -1
timeout 400 $PY benchmarks/compile_check.py "$G" --ring-gb 0.5 --gpu-gb 0.5 --new-tokens 16 --out "$OUT/compile.jsonl" \
  2>"$OUT/compile.log" | cut -c1-1500
tail -5 "$OUT/compile.log"
