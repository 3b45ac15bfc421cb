#!/usr/bin/env bash
# Routed-expert reads by reader backend, and compiled decoding after the recompile-limit fix, in one command:
# the CUDA tests; benchmarks/compile_check.py on a streamed TinyLlama-shaped model; then the Mixtral-8x7B shape
# (6 layers, bf16, warm page cache, ring_gb=6, gpu_gb=2: no room for an expert cache) routed with io=mmap and
# 4 threads (the default) and io=pread with 16 threads, alternating; then the Llama-3-70B shape (6 layers,
# ring_gb=1, gpu_gb=0). Each model's `tiered inspect` placement and predicted s/token is saved next to its runs
# (inspect_*.json). Results in $OUT.
#   MIXTRAL_LAYERS=6 REPS=1 SKIP_TESTS=0 bash benchmarks/gpu_experts_io_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
G="$CACHE/tinyllama-bf16"
$PY benchmarks/make_checkpoint.py --arch tinyllama-1.1b --dtype bf16 --quiet "$G" 2>&1 | tail -1
$PY -m tiered.cli inspect "$G" --device cuda --ring-gb 0.5 --gpu-gb 0.5 --json > "$OUT/inspect_tinyllama.json"
timeout 300 $PY benchmarks/compile_check.py "$G" --ring-gb 0.5 --gpu-gb 0.5 --new-tokens 16 --out "$OUT/compile.jsonl" \
  2>"$OUT/compile.log" | cut -c1-900
grep -c "recompile_limit" "$OUT/compile.log"
ML=${MIXTRAL_LAYERS:-6}
make_warm mixtral-8x7b "$ML"
$PY -m tiered.cli inspect "$G" --device cuda --ring-gb 6 --gpu-gb 2 --json > "$OUT/inspect_mixtral_gpu2.json"
for i in $(seq 1 "${REPS:-1}"); do
  for v in ${VARIANTS:-"mmap 4" "pread 16"}; do
    set -- $v
    timeout 300 $PY benchmarks/stream_run.py "$G" --out "$OUT/experts_io.jsonl" --label "mixtral-routed-gpu2-$1-t$2-$i" \
      --ring-gb 6 --gpu-gb 2 --io "$1" --threads "$2" --new-tokens 16 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-160
  done
done
rm -rf "$G"
G="$CACHE/llama3-70b-bf16-L6"
$PY benchmarks/make_checkpoint.py --arch llama3-70b --dtype bf16 --layers 6 --quiet "$G" 2>&1 | tail -1
cat "$G"/*.safetensors > /dev/null
$PY -m tiered.cli inspect "$G" --device cuda --ring-gb 1 --gpu-gb 0 --json > "$OUT/inspect_llama70.json"
timeout 300 $PY benchmarks/stream_run.py "$G" --out "$OUT/experts_io.jsonl" --label "llama70-L6-ring1-gpu0" --ring-gb 1 \
  --gpu-gb 0 --new-tokens 8 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-160
