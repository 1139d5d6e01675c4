#!/usr/bin/env bash
# Issue 29's check that the restructuring changed no figure: the async-scheduling decode steps and the speculative
# steps of the tree before it and of this tree, back to back on one GPU, each tree measured by its own scripts.
#
#   git archive 57c8014 hyserve benchmarks ':!hyserve/default_model' | tar -x -C .bench_before   # here, untracked
#   OUT=... bash benchmarks/restructure_bench.sh async|spec                                      # on the GPU machine
set -u
OUT=${OUT:?}
BEFORE=${BEFORE:-.bench_before}
# fla-core (GDN prefill on CUDA) from wheels carried in .whl, as benchmarks/peer_session.sh installs them
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
trees=("before:$BEFORE" "after:.")
case "${1:-}" in
  async)  # decode steps of the 2B shape at batch 1..64, synchronous and async scheduling (benchmarks/async_bench.py)
    for t in "${trees[@]}"; do
      name=${t%%:*}; dir=${t#*:}
      (cd "$dir" && timeout 280 python3 benchmarks/async_bench.py --out "$OUT" --name "async_$name" \
          --batches 1,8,32,64 --steps 200 > "$OUT/async_$name.log" 2>&1)
      echo "async $name rc $?"; tail -12 "$OUT/async_$name.log"
    done ;;
  spec)  # MTP k = 3 at a planted 80 % acceptance on the 2B shape, batch 1 and 32 (benchmarks/spec_decode_bench.py)
    [ -d /tmp/mtp2b ] || python3 benchmarks/shapes.py --shape 2b --mtp --init stable --out /tmp/mtp2b > /dev/null 2>&1
    for t in "${trees[@]}"; do
      name=${t%%:*}; dir=${t#*:}
      (cd "$dir" && timeout 250 python3 benchmarks/spec_decode_bench.py --model /tmp/mtp2b --device cuda \
          --dtype bfloat16 --out "$OUT/spec_$name" --max-tokens 64 --rates 0.8 --batches 1,32 > "$OUT/spec_$name.log" 2>&1)
      echo "spec $name rc $?"; tail -6 "$OUT/spec_$name.log"
    done ;;
  *) echo "usage: OUT=DIR bash benchmarks/restructure_bench.sh async|spec" >&2; exit 2 ;;
esac
