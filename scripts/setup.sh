#!/usr/bin/env bash
# Create .venv (once) and install dspark-serve with its test extras into it.
# CPU machines get torch==2.13.0 (a local CPU build); where torch is already present it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip setuptools wheel
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[test]"
