#!/usr/bin/env bash
# The README's first command as a new user meets it: a fresh clone of this repository's HEAD in a temporary folder,
# pip with no configuration files, no local wheel folder, no constraints and an empty cache (so only the package
# registry serves it), then `bash scripts/setup.sh && .venv/bin/hyserve demo`; with --tests, the README's second
# command too. It downloads gigabytes (torch's registry build), so CI does not run it.
#
#   bash scripts/check_fresh_install.sh [--tests] [--keep]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
run_tests=0
keep=0
for arg in "$@"; do
  case "$arg" in
    --tests) run_tests=1 ;;
    --keep) keep=1 ;;
    *) echo "usage: $0 [--tests] [--keep]" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d "${TMPDIR:-/tmp}/hyserve-fresh.XXXXXX")
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/hyserve"
cd "$work/hyserve"
echo "# fresh clone of $(git rev-parse --short HEAD) in $work/hyserve; $(python3 --version)"

# Registry only: no pip.conf (PIP_CONFIG_FILE=/dev/null loads none), no find-links, constraints or extra indexes
# from the environment, and a cache of its own.
unset PIP_FIND_LINKS PIP_CONSTRAINT PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_NO_INDEX PIP_REQUIREMENT
export PIP_CONFIG_FILE=/dev/null PIP_CACHE_DIR="$work/pip-cache"
SECONDS=0
bash scripts/setup.sh
echo "# setup: ${SECONDS} s, .venv $(du -sh .venv | cut -f1), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), triton $(.venv/bin/python -c 'import triton; print(triton.__version__)')"
SECONDS=0
.venv/bin/hyserve demo
echo "# demo: ${SECONDS} s"
if [ "$run_tests" = 1 ]; then
  SECONDS=0
  bash scripts/test.sh
  echo "# tests: ${SECONDS} s"
fi
