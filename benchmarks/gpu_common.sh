# Sourced by the benchmarks/gpu_*_check.sh scripts: the shared prelude. Runs in the repository root, results in
# $OUT (default /tmp/tiered-out), generated checkpoints in $TIERED_CACHE (default /tmp/tiered-cache), Python
# from $PYTHON (default python3); records the GPU in $OUT/machine.txt. `cuda_tests [FILES...]` runs
# `pytest -m cuda` (default: tests/test_cuda.py tests/test_compile.py) into $OUT/pytest_cuda.txt unless
# SKIP_TESTS=1. `make_warm ARCH LAYERS` generates $CACHE/ARCH-bf16-L$LAYERS once (benchmarks/make_checkpoint.py),
# reads it into the page cache and sets G to its path.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tiered-out}; mkdir -p "$OUT"
CACHE=${TIERED_CACHE:-/tmp/tiered-cache}; mkdir -p "$CACHE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=.
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"

cuda_tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && return 0
  local files=("$@"); [ ${#files[@]} -eq 0 ] && files=(tests/test_cuda.py tests/test_compile.py)
  $PY -m pytest -q -m cuda "${files[@]}" -p no:cacheprovider 2>&1 \
    | grep -v "Loading weights\|Writing model" | tee "$OUT/pytest_cuda.txt" | tail -15
}

make_warm() {
  G="$CACHE/$1-bf16-L$2"
  $PY benchmarks/make_checkpoint.py --arch "$1" --dtype bf16 --layers "$2" --quiet "$G" 2>&1 | tail -1
  cat "$G"/*.safetensors > /dev/null
}
