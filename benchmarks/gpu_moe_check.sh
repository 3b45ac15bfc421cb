#!/usr/bin/env bash
# Routed experts on the GPU machine, in one command: the CUDA tests (tests/test_cuda.py, test_compile.py),
# then a Mixtral-8x7B-shaped and a Qwen3-30B-A3B-shaped bf16 checkpoint (real layer shapes, layers cut to
# fit the disk) streamed from a warm page cache with ring_gb=6, gpu_gb=2, alternating routed experts
# (default) and dense streaming (--no-routed-experts: every expert, every token), twice each, side by
# side; then accelerate disk offload of the Mixtral shape at the same GPU budget. Results go to $OUT.
#   MIXTRAL_LAYERS=6 QWEN_LAYERS=12 REPS=2 SKIP_TESTS=0 SKIP_ACCELERATE=0 bash benchmarks/gpu_moe_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
R="$OUT/moe_side_by_side.jsonl"
for spec in "mixtral-8x7b:${MIXTRAL_LAYERS:-6}" "qwen3-30b-a3b:${QWEN_LAYERS:-12}"; do
  arch=${spec%%:*}; layers=${spec##*:}
  G="$CACHE/$arch-bf16-L$layers"
  $PY benchmarks/make_checkpoint.py --arch "$arch" --dtype bf16 --layers "$layers" --quiet "$G" 2>&1 | tail -1
  cat "$G"/*.safetensors > /dev/null  # warm the page cache
  for i in $(seq 1 "${REPS:-2}"); do
    for mode in routed dense; do
      extra=""; [ "$mode" = dense ] && extra="--no-routed-experts"
      timeout 300 $PY benchmarks/stream_run.py "$G" --out "$R" --label "$arch-$mode-$i" --ring-gb 6 --gpu-gb 2 \
        --new-tokens 8 --threads 4 $extra 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-400
    done
  done
done
if [ "${SKIP_ACCELERATE:-0}" != 1 ]; then
  G="$CACHE/mixtral-8x7b-bf16-L${MIXTRAL_LAYERS:-6}"
  $PY - "$G" "$OUT/accelerate_spec.json" <<'PY'
import json, sys, torch
torch.manual_seed(0)
ids = torch.randint(100, 30000, (16,)).tolist()
json.dump({"system": "accelerate", "model_dir": sys.argv[1], "prompt_ids": ids, "new_tokens": 4, "device": "cuda",
           "gpu_gb": 2.0, "cpu_gb": 1.0, "offload_folder": "/tmp/tiered-acc-offload"}, open(sys.argv[2], "w"))
PY
  timeout ${ACC_TIMEOUT:-240} $PY benchmarks/systems.py "$OUT/accelerate_spec.json" 2>"$OUT/accelerate.log" | grep BENCH_RESULT \
    | tee "$OUT/accelerate.jsonl" | cut -c1-600
  tail -5 "$OUT/accelerate.log"
fi
