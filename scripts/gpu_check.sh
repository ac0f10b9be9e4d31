#!/usr/bin/env bash
# Every CUDA path checked and every GPU target measured, in one call of under 10 minutes
# (issue 20). Runs from the source tree; results go to $OUT (or --out DIR):
# results.md (for benchmarks/HISTORY.md), results.json and one log per stage.
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh              # on a GPU machine
#   OUT=/tmp/gpu_dry bash scripts/gpu_check.sh --dry-run  # tiny sizes; CPU is fine
#   bash scripts/gpu_check.sh --out DIR --stages tests,mfu --budget 300
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
exec "$PYTHON" benchmarks/gpu_suite.py "$@"
