#!/usr/bin/env bash
# Routed experts from the host tier (issue 8's Mixtral target, issue 9's host tier), in one command: the CUDA
# tests; then a Mixtral-8x7B-shaped bf16 checkpoint (6 layers, 17.9 GB) from a warm page cache, ring_gb=6,
# gpu_gb=2: routed and dense (routed_experts=False), each without a host tier and with host_gb=20 (the dense run's
# units, or the routed run's units plus every block's experts, in pinned host memory), alternating, REPS times;
# then the Qwen3-30B-A3B shape (12 layers) the same way, once. Results in $OUT/host_experts.jsonl.
# WITHOUT_HOST=1 adds the runs without a host tier; PROFILE=1 adds benchmarks/moe_profile.py --host-gb 20 --profile of each
# shape ($OUT/profile-ARCH.txt: resident floor, routed+host, and where its GPU and CPU time go). Each run decodes
# WARMUP tokens first, unmeasured (default 16; 0 measures from the first token after load), from a prompt of
# WARMUP_PROMPT_LEN tokens (default 64, so the measured decode's sequence lengths 16-32 are new to the process, as in
# one long generation; 16 repeats them, which made routed decoding 1.5x faster on 2026-12-01: benchmarks/NOTES.md).
# NO_CUDNN_SDP=1 runs every tiered run with SDPA's cuDNN backend off (stream_run.py --no-cudnn-sdp).
# PREFETCH=1 adds each routed run with --expert-prefetch (tiered/speculate.py) beside it. ACCELERATE=1 adds accelerate disk offload of each shape at the
# same GPU budget (max_memory cuda 2 GiB, cpu 1 GiB; 4 tokens; $OUT/accelerate-ARCH.jsonl).
#   MIXTRAL_LAYERS=6 QWEN_LAYERS=12 REPS=2 WARMUP=16 WARMUP_PROMPT_LEN=64 SKIP_TESTS=0 SKIP_MIXTRAL=0 SKIP_QWEN=0 WITHOUT_HOST=0 PROFILE=0 \
#     ACCELERATE=0 PREFETCH=0 NO_CUDNN_SDP=0 bash benchmarks/gpu_host_experts_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
R="$OUT/host_experts.jsonl"
run() {  # checkpoint, label, then stream_run flags
  local g=$1 label=$2; shift 2
  timeout 300 $PY benchmarks/stream_run.py "$g" --out "$R" --label "$label" --ring-gb 6 --gpu-gb 2 --new-tokens 16 \
    --threads 4 --warmup-tokens "${WARMUP:-16}" --warmup-prompt-len "${WARMUP_PROMPT_LEN:-64}" \
    $([ "${NO_CUDNN_SDP:-0}" = 1 ] && echo --no-cudnn-sdp) "$@" 2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-220
}
accelerate() {  # arch: accelerate disk offload of $G at the same GPU budget
  [ "${ACCELERATE:-0}" = 1 ] || return 0
  $PY - "$G" "$OUT/accelerate_spec.json" <<'PY'
import json, sys, torch
torch.manual_seed(0)
ids = torch.randint(100, 30000, (16,)).tolist()
json.dump({"system": "accelerate", "model_dir": sys.argv[1], "prompt_ids": ids, "new_tokens": 4, "device": "cuda",
           "gpu_gb": 2.0, "cpu_gb": 1.0, "offload_folder": "/tmp/tiered-acc-offload"}, open(sys.argv[2], "w"))
PY
  timeout "${ACC_TIMEOUT:-240}" $PY benchmarks/systems.py "$OUT/accelerate_spec.json" 2>"$OUT/accelerate-$1.log" \
    | grep BENCH_RESULT | tee "$OUT/accelerate-$1.jsonl" | cut -c1-300
  rm -rf /tmp/tiered-acc-offload
}
profile() {
  [ "${PROFILE:-0}" = 1 ] || return 0
  timeout 300 $PY benchmarks/moe_profile.py "$G" --host-gb 20 --profile > "$OUT/profile-$1.txt" 2>&1
  tail -1 "$OUT/profile-$1.txt" | cut -c1-400
}
if [ "${SKIP_MIXTRAL:-0}" != 1 ]; then
  make_warm mixtral-8x7b "${MIXTRAL_LAYERS:-6}"
  for i in $(seq 1 "${REPS:-2}"); do
    run "$G" "mixtral-routed-host20-$i" --host-gb 20
    run "$G" "mixtral-dense-host20-$i" --host-gb 20 --no-routed-experts
    [ "${PREFETCH:-0}" = 1 ] && run "$G" "mixtral-routed-prefetch-host20-$i" --host-gb 20 --expert-prefetch
    [ "${WITHOUT_HOST:-0}" = 1 ] && run "$G" "mixtral-routed-$i"
    [ "${WITHOUT_HOST:-0}" = 1 ] && run "$G" "mixtral-dense-$i" --no-routed-experts
  done
  profile mixtral
  accelerate mixtral
  rm -rf "$G"
fi
[ "${SKIP_QWEN:-0}" = 1 ] && exit 0
make_warm qwen3-30b-a3b "${QWEN_LAYERS:-12}"
run "$G" "qwen3-routed-host20" --host-gb 20
run "$G" "qwen3-dense-host20" --host-gb 20 --no-routed-experts
[ "${PREFETCH:-0}" = 1 ] && run "$G" "qwen3-routed-prefetch-host20" --host-gb 20 --expert-prefetch
[ "${WITHOUT_HOST:-0}" = 1 ] && run "$G" "qwen3-routed"
profile qwen3
accelerate qwen3
rm -rf "$G"
