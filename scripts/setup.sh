#!/usr/bin/env bash
# Create .venv and install hyserve with its test tools, from the package registry alone.
#
# torch is pinned (scripts/constraints.txt). pip takes the build the machine offers: a local CPU build where one lies
# on disk (this project's CI machines), else the registry's (on Linux x86-64 that is the CUDA build, which brings its
# own pinned triton and the NVIDIA runtime libraries: about 4 GB of downloads, 7 GB in the venv; it runs on the CPU
# too). Only a torch build that pins no triton (a CPU build) gets triton pinned to the GPU machine's release
# (scripts/constraints-triton.txt), so that the Triton interpreter tests run the Triton the GPU runs; a torch that
# pins its own triton keeps it. Set HYSERVE_PIP_QUIET=1 for less output.
# transformers 5.24 (no deps) in .venv/reference/transformers-5.24: Qwen4-Exp's test reference, run in a subprocess.
set -euo pipefail
cd "$(dirname "$0")/.."
quiet=()
[ "${HYSERVE_PIP_QUIET:-0}" = 1 ] && quiet=(-q)
start=$SECONDS
step() { printf '\n== setup [%3ds] %s\n' "$((SECONDS - start))" "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $(python3 --version)"
  python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install "${quiet[@]}" --progress-bar on)
step "pip"
.venv/bin/python -m pip install -q --upgrade pip
step "torch (pinned in scripts/constraints.txt)"
"${pip[@]}" -c scripts/constraints.txt torch
constraints=(-c scripts/constraints.txt)
if .venv/bin/python - <<'PY'
import importlib.metadata as md
import sys
sys.exit(0 if any(r.split(";")[0].strip().startswith("triton") for r in md.requires("torch") or []) else 1)
PY
then
  step "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') pins its own triton"
else
  step "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') pins no triton: triton from scripts/constraints-triton.txt"
  constraints+=(-c scripts/constraints-triton.txt)
fi
step "hyserve and its test tools (pip install -e '.[test]')"
"${pip[@]}" "${constraints[@]}" -e '.[test]'
reference=.venv/reference/transformers-5.24
if [ -d "$reference/transformers-5.24.0.dist-info" ]; then
  step "transformers 5.24.0 (the Qwen4-Exp reference) already in $reference"
else
  step "transformers 5.24.0 (the Qwen4-Exp reference) into $reference, without dependencies (the venv's serve it)"
  rm -rf "$reference"
  "${pip[@]}" --no-deps --target "$reference" transformers==5.24.0
fi
step "done: $(du -sh .venv | cut -f1) in .venv"
