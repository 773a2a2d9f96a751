#!/usr/bin/env bash
# The test command of the README (and of CI): lint, format check, type check (strict on the packages
# pyproject.toml names), then the whole suite, slow end-to-end tests included. With arguments, one
# pytest run of those arguments (e.g. a test file).
#
# The unit tests are single-process and independent: pytest-xdist runs them on two workers, which
# about halves their time on two cores. The multi-rank and end-to-end tests already use every core
# (and some measure how long a hang takes to be reported), so they run one at a time after them.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE=offline WANDB_SILENT=true
python3 -m ruff check megatron tools tests pretrain_gpt.py
python3 -m ruff format --check megatron tools tests bench examples pretrain_gpt.py setup.py
python3 -m mypy megatron
PYTEST=(python3 -m pytest -q -p no:cacheprovider --durations=15)
if [ "$#" -gt 0 ]; then
    exec "${PYTEST[@]}" "$@"
fi
workers=()
if python3 -c "import xdist" 2>/dev/null; then
    workers=(-n 2)
fi
"${PYTEST[@]}" "${workers[@]}" tests/unit
"${PYTEST[@]}" tests/distributed tests/functional tests/gpu
