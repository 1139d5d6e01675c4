#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check hyserve tests benchmarks training
.venv/bin/mypy
# Two workers (the CI machine's two cores; each test process keeps one thread), a test file's tests on one worker so
# that its module fixtures are built once, the longest files first (tests/conftest.py, tests/file_seconds.json).
# Tests marked slow (over a minute, docs/testing.md) are left out: a later -m (scripts/test.sh -m slow) replaces
# this one.
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" "$@"
