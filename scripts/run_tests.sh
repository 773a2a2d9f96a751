#!/usr/bin/env bash
# The test command of the README (and of CI): lint, type check, then the whole suite, slow end-to-end
# tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE=offline WANDB_SILENT=true
python3 -m ruff check megatron tools tests pretrain_gpt.py
python3 -m mypy megatron
python3 -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
