#!/usr/bin/env bash
# The GPU checks in one prepared run, for a machine with CUDA whose python3 already holds torch
# (the lent device machines; nothing is downloaded). Run from the repository root; results go
# to $OUT (default runs/gpu_check), seven files at most two folders down:
#   pytest.log   GPU, driver and torch, then the kernel tests (on CUDA: Triton kernels against
#                their references) and the device tests (the engine on CUDA: greedy identical
#                to the target alone, seeded sampling repeatable)
#   kernels.log  `python -m dspark.kernels.check`: kernels against references, then timed
#   bench.log    policies side by side at 1 and 64 in flight, T = 0: `confidence` against `off`
#                and fixed k = 3, 7 (issue 4's GPU goal), and in bench/ its JSON and PNG and
#                the cost profile it measured on CUDA (cost_profile.json, .png)
# Each stage has its own time limit, so a hang costs that stage only; the exit status is the
# number of stages that failed. Stage limits add up to 9.5 minutes; expect about 5 on an H200.
set -uo pipefail
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python3}"
device="${DEVICE:-cuda}"  # DEVICE=cpu CONCURRENCY=1: a dry run of the script on a CPU machine
concurrency="${CONCURRENCY:-1,64}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
failed=0

# Installed outside the checkout (no network: no dependencies, no build isolation); commands run
# from / so the checkout's own `dspark/` folder cannot shadow the installed package.
site="${TMPDIR:-/tmp}/dspark-site"
"$py" -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$site" . \
  >"$site.log" 2>&1 || { cat "$site.log"; exit 100; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
repo="$(pwd)"

stage() {  # stage NAME SECONDS COMMAND...: one check, logged to $out/NAME.log; counts a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  if ! timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; then
    echo "== $name FAILED"
    failed=$((failed + 1))
  fi
}

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
}
export py repo
export -f environment

cost_dir="$HOME/.cache/dspark/cost"
stage pytest 180 bash -c 'environment; "$py" -m pytest -q -p no:cacheprovider --timeout=150 \
  "$repo/tests/unit/test_device.py" "$repo"/tests/unit/test_kernel_*.py'
cd / || exit 100
stage kernels 120 "$py" -m dspark.kernels.check
stage bench 260 "$py" -m dspark.cli bench-policies --device "$device" --concurrency "$concurrency" \
  --temperatures 0 --arms 'off,fixed k=3,fixed k=7,confidence' --max-tokens 32 --repeats 2 \
  --out "$out/bench"
# The profile the bench's `confidence` engine used (measured there, on a fresh machine)
profile=$(ls -t "$cost_dir"/*-dspark-TargetRunner-*.json 2>/dev/null | head -n 1)
if [ -n "$profile" ]; then
  cp "$profile" "$out/bench/cost_profile.json"
  "$py" -c 'import sys; from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.profiler import plot
plot(CostModel.load(sys.argv[1]), sys.argv[2])' "$profile" "$out/bench/cost_profile.png"
fi
echo "gpu_check: $failed stage(s) failed; results in $out"
exit "$failed"
