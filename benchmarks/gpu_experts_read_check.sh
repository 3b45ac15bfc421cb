#!/usr/bin/env bash
# Routed-expert read parameters on the Mixtral-8x7B shape (6 layers, bf16, warm page cache, ring_gb=6, gpu_gb=2: no
# room for an expert cache), alternating: the defaults (256 MiB pinned staging, 8 MiB reader tasks), 32 MiB tasks,
# 1 GiB staging with 32 MiB tasks, and that with 8 reader threads. Results in $OUT/experts_read.jsonl.
#   MIXTRAL_LAYERS=6 REPS=1 SKIP_TESTS=1 bash benchmarks/gpu_experts_read_check.sh
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
ML=${MIXTRAL_LAYERS:-6}
make_warm mixtral-8x7b "$ML"
for i in $(seq 1 "${REPS:-1}"); do
  for v in "8 256 4" "32 256 4" "32 1024 4" "32 1024 8"; do
    set -- $v
    timeout 300 $PY benchmarks/stream_run.py "$G" --out "$OUT/experts_read.jsonl" --label "mixtral-gpu2-chunk$1-staging$2-t$3-$i" \
      --ring-gb 6 --gpu-gb 2 --threads "$3" --expert-read-chunk-mib "$1" --expert-staging-mib "$2" --new-tokens 16 \
      2>&1 | grep -v "Loading weights" | tail -1 | cut -c1-120
  done
done
