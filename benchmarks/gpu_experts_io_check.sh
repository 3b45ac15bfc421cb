#!/usr/bin/env bash
# Routed-expert reads by reader backend, and compiled decoding after the recompile-limit fix, in one command:
# the CUDA tests; benchmarks/compile_check.py on a streamed TinyLlama-shaped model; then the Mixtral-8x7B shape
# (6 layers, bf16, warm page cache, ring_gb=6, gpu_gb=2: no room for an expert cache) routed with io=mmap and
# 4 threads (the default), io=pread with 16 threads, and io=mmap with 16 threads, alternating. Results in $OUT.
#   MIXTRAL_LAYERS=6 REPS=1 SKIP_TESTS=0 bash benchmarks/gpu_experts_io_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
G="$CACHE/tinyllama-bf16"
$PY benchmarks/make_checkpoint.py --arch tinyllama-1.1b --dtype bf16 --quiet "$G" 2>&1 | tail -1
timeout 300 $PY benchmarks/compile_check.py "$G" --ring-gb 0.5 --gpu-gb 0.5 --new-tokens 16 --out "$OUT/compile.jsonl" \
  2>"$OUT/compile.log" | cut -c1-900
grep -c "recompile_limit" "$OUT/compile.log"
ML=${MIXTRAL_LAYERS:-6}
G="$CACHE/mixtral-8x7b-bf16-L$ML"
$PY benchmarks/make_checkpoint.py --arch mixtral-8x7b --dtype bf16 --layers "$ML" --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null
for i in $(seq 1 "${REPS:-1}"); do
  for v in "mmap 4" "pread 16" "mmap 16"; do
    set -- $v
    timeout 300 $PY benchmarks/stream_run.py "$G" --out "$OUT/experts_io.jsonl" --label "mixtral-routed-gpu2-$1-t$2-$i" \
      --ring-gb 6 --gpu-gb 2 --io "$1" --threads "$2" --new-tokens 16 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-160
  done
done
