#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check hyserve tests benchmarks training
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
