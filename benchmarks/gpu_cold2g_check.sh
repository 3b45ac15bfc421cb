#!/usr/bin/env bash
# The low-RAM host (issue 9): GPT-J-6B fp16 in a 2 GiB cgroup (memory.max), cold page cache, GPU budget 3 GiB, in
# one command: the CUDA tests; then benchmarks/run.py with accelerate disk offload (max_memory cpu 0.8 GiB),
# tiered io=direct with a 0.45 GiB ring, and tiered io=direct with a ring smaller than a layer (PIECES_RING, GiB:
# every layer streams in pieces, reads pipelined) without and with host tiers (PIECES_HOST, comma list of GiB) that
# hold the first pieces of the layers. REPEAT=N runs them in N rounds of alternating order (the report adds each run's
# median and accelerate's median divided by it: the disk here drifts by up to 1.5x between minutes); RUNS narrows the
# runs (fnmatch patterns on run.py's keys). Results in $OUT/<date>-<machine>-full-cold2g.{md,json}.
#   PIECES_RING=0.15 PIECES_HOST=0.2,0.34 REPEAT=1 SKIP_TESTS=0 bash benchmarks/gpu_cold2g_check.sh
#   e.g. REPEAT=3 PIECES_HOST=0.2 RUNS='main/accelerate-*,main/tiered-streamed-pieces-host*' SKIP_TESTS=1 ...
source "$(dirname "$0")/gpu_common.sh"
cuda_tests
timeout "${RUN_TIMEOUT:-540}" $PY benchmarks/run.py --suite full --device cuda --groups limit,io --mem-limit-gb 2 \
  --gpu-gb 3 --ring-gb 0.45 --cpu-gb 0.8 --pieces-ring-gb "${PIECES_RING:-0.15}" --pieces-host-gb "${PIECES_HOST:-0.2,0.34}" \
  --runs "${RUNS:-main/accelerate-*,main/tiered-streamed/original/direct/cold/limit,main/tiered-streamed-pieces*}" \
  --repeat "${REPEAT:-1}" \
  --out-dir "$OUT" --no-plots --tag cold2g 2>&1 | grep -v "Loading weights" | tail -40
