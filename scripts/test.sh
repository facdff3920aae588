#!/usr/bin/env bash
# The test suite: set up, then the slow tier (statistical / end-to-end tests marked `slow`, if
# any) and the default tier, as separate pytest runs. The default tier runs last so its summary
# closes the output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python -m pytest -m "slow and not gpu" -q --timeout=1800 "$@" || [ $? -eq 5 ]
python -m pytest -m "not slow and not gpu" -q --timeout=900 "$@"
