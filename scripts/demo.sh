#!/usr/bin/env bash
# The main job: set up, then run the demo models with and without speculation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
dspark demo "$@"
