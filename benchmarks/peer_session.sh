#!/usr/bin/env bash
# The side-by-side run of issue 14 on the lent H200, in the device calls that follow vLLM's bring-up
# (../shared/peer/README.md). One phase per call, back to back (the machine's /tmp lasts while it is warm):
#
#   bash benchmarks/peer_session.sh 2b      # hyserve, then vLLM: decode, bound, prefill, agent (+ MTP) on the 2B shape
#   bash benchmarks/peer_session.sh 9b      # both: decode, bound, prefill, warm start on the 9B shape
#   bash benchmarks/peer_session.sh spec    # hyserve: MTP k = 2 on the packaged model, planted MTP k = 3 on 2B
#
# Each engine runs in processes of its own (vLLM does not free the GPU within one), each under a timeout; every
# process writes its JSON and log under $OUT. Then, here: python benchmarks/peer_bench.py report <files>.
set -u
OUT=${OUT:?}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
VLLM_ENV=(env PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0)
MTP3='{"method": "mtp", "num_speculative_tokens": 3}'
PB=benchmarks/peer_bench.py

measure() {  # measure ENGINE MODEL NAME TIMEOUT ARGS...
    local engine=$1 model=$2 name=$3 limit=$4
    shift 4
    local pre=()
    [ "$engine" = vllm ] && pre=("${VLLM_ENV[@]}")
    echo "== $engine $name ($(date +%T))"
    "${pre[@]}" timeout "$limit" python3 $PB measure --engine "$engine" --model "$model" --out "$OUT/${engine}_$name.json" \
        "$@" > "$OUT/${engine}_$name.log" 2>&1
    echo "   rc $? ($(date +%T))"
    tail -3 "$OUT/${engine}_$name.log"
}

case "${1:?phase}" in
  2b)
    [ -d /tmp/p2b ] || python3 $PB write --shape 2b --out /tmp/p2b > "$OUT/write_2b.log" 2>&1
    measure hyserve /tmp/p2b 2b 200 --measures decode,bound,prefill
    measure hyserve /tmp/p2b 2b_agent 120 --measures agent
    measure hyserve /tmp/p2b 2b_agent_mtp 120 --measures agent --speculative-config "$MTP3"
    measure vllm /tmp/p2b 2b 330 --measures decode,bound,prefill
    ;;
  2b-vllm-agent)
    measure vllm /tmp/p2b 2b_agent 180 --measures agent
    measure vllm /tmp/p2b 2b_agent_mtp 180 --measures agent --speculative-config "$MTP3"
    ;;
  9b)
    [ -d /tmp/p9b ] || python3 $PB write --shape 9b --out /tmp/p9b > "$OUT/write_9b.log" 2>&1
    measure hyserve /tmp/p9b 9b 200 --measures decode,bound,prefill
    measure hyserve /tmp/p9b 9b_start 120 --measures start
    ;;
  9b-vllm)
    measure vllm /tmp/p9b 9b 330 --measures decode,bound,prefill
    measure vllm /tmp/p9b 9b_start 180 --measures start
    ;;
  spec)
    measure hyserve hyserve/default_model packaged_spec 150 --measures spec --spec-batches 1,8 --max-model-len 4096 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
    [ -d /tmp/mtp2b ] || python3 benchmarks/shapes.py --shape 2b --mtp --init stable --out /tmp/mtp2b > /dev/null 2>&1
    timeout 200 python3 benchmarks/spec_decode_bench.py --model /tmp/mtp2b --device cuda --dtype bfloat16 \
        --out "$OUT/spec_mtp2b" --max-tokens 64 --rates 0.8 --batches 1,32 > "$OUT/spec_mtp2b.log" 2>&1
    echo "spec bench rc $?"; tail -4 "$OUT/spec_mtp2b.log"
    ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
