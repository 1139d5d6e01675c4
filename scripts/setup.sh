#!/usr/bin/env bash
# Create .venv and install hyserve with its test tools. Pins torch to the CPU build (see constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
