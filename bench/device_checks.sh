#!/usr/bin/env bash
# The GPU checks in one run: the `cuda` tests, the kernel throughput at 64 MiB and 1 GiB,
# the pytest-benchmark CUDA cases, and compute-sanitizer memcheck over a kernel subset.
# Logs go to $OUT (default ./device_out). Run from the repository root on a machine
# with a GPU, CuPy and torch:  bash bench/device_checks.sh
# qcoll is taken from a wheel in .whl/ when one is there (built beforehand with
# `pip wheel --no-deps -w .whl .`), else installed editable without dependencies.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 QCOLL_CACHE_DIR=/tmp/qcoll-cache
py="python3 -P"   # -P: never import ./qcoll (the source tree) over the installed package

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  if ls .whl/qcoll-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/qcoll-site .whl/qcoll-*.whl
    export PYTHONPATH=/tmp/qcoll-site
  else
    python3 -m pip install -q --no-deps --no-build-isolation -e .
  fi
  $py -c "import torch, cupy, qcoll, qcoll.bindings.ops as o; from qcoll.bindings import nvrtc
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, 'nvrtc', nvrtc.nvrtc_version())
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), qcoll.__file__)"
} 2>&1 | tee "$OUT/env.txt"   # (a subshell: export again below)
if ls .whl/qcoll-*.whl >/dev/null 2>&1; then export PYTHONPATH=/tmp/qcoll-site; fi

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record the exit code
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

step cuda_tests 200 $py -m pytest -m cuda -q -rfEs -p no:cacheprovider tests
step throughput_1g 90 $py bench/codec_throughput.py --device cuda --mib 1024 --repeat 20 --bits 8 6 4 2
step throughput_64m 40 $py bench/codec_throughput.py --device cuda --mib 64 --repeat 50 --bits 8 4
step bench_cuda 100 $py -m pytest bench/test_codec_benchmark.py -m cuda -q -p no:cacheprovider \
  --benchmark-enable --benchmark-max-time=0.2 --benchmark-json="$OUT/bench_cuda.json" --benchmark-columns=min,median,mean
if command -v compute-sanitizer >/dev/null; then
  step memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 9 $py -m pytest -q -p no:cacheprovider \
    tests/test_cuda_kernels.py -k "unaligned or random_bytes or empty or swizzle or (quantize_dequantize and 5-64) or (reductions and 300)"
fi
cat "$OUT/summary.txt"
