#!/usr/bin/env bash
# The side-by-side run of issue 14 on the lent H200, in the device calls that follow vLLM's bring-up
# (../shared/peer/README.md). One phase per call, back to back (the machine's /tmp lasts while it is warm):
#
#   bash benchmarks/peer_session.sh 2b      # hyserve: decode, bound, prefill, agent (+ MTP); vLLM: decode, bound, prefill
#   bash benchmarks/peer_session.sh 2b-vllm-agent   # vLLM: the agent trace, plain and with MTP
#   bash benchmarks/peer_session.sh 9b      # hyserve: decode, bound, prefill, warm start on the 9B shape
#   bash benchmarks/peer_session.sh 9b-vllm # vLLM: the same
#   bash benchmarks/peer_session.sh 9b-profile   # hyserve: a batch-1 decode step of the 9B shape, profiled
#   bash benchmarks/peer_session.sh spec    # hyserve: MTP k = 2 on the packaged model, planted MTP k = 3 on 2B
#   bash benchmarks/peer_session.sh adaptive-off ; adaptive-on   # issue 34: 2B planted MTP k = 3 at 80 % and 0 %,
#                                               # batch 1/8/32/64, fixed k then k chosen per step (steps by k reported)
#   bash benchmarks/peer_session.sh adaptive-packaged   # issue 34: the packaged model's head, k = 3, fixed and adaptive
#   bash benchmarks/peer_session.sh check   # the GPU tests and gpu_check (2B bf16 against transformers)
#   bash benchmarks/peer_session.sh stash-caches   # carrying .peer/vllm_caches.tgz.NN: vLLM's compile caches
#   bash benchmarks/peer_session.sh vllm-first | vllm-agent | vllm-start | vllm-rest   # vLLM alone (see below)
#   bash benchmarks/peer_session.sh kvfp8   # both engines: the agent trace with --kv-cache-dtype fp8
#   bash benchmarks/peer_session.sh fp8 ; fp8-vllm   # FP8 checkpoints of the 2B shape: kernels and hyserve, then vLLM
#   bash benchmarks/peer_session.sh first   # vLLM's first (compiling) process with the checks beside it
#   bash benchmarks/peer_session.sh 9b-all  # hyserve's 9B figures and profile
#   bash benchmarks/peer_session.sh fp8-measure ; fp8-9b   # hyserve: bf16 against FP8 on the 2B shape; the 9B in FP8
#   bash benchmarks/peer_session.sh 9b-both ; profile-fp8   # 9B both engines in one call; 9B profile + the FP8 2B figures
#   bash benchmarks/peer_session.sh images  # real-tower 2B: hyserve's screenshot agent trace at 8 and 32, then vlm-2b-check
#   bash benchmarks/peer_session.sh images-vllm ; images-vllm32   # vLLM's screenshot trace at 8 then 32; at 32 alone
#   bash benchmarks/peer_session.sh images-check   # gpu_check.py --images-only: the tiny VLM on CUDA against transformers
#   bash benchmarks/peer_session.sh vlm-2b-check   # gpu_check.py --vlm-2b: the real-tower 2B VLM in bf16 against transformers fp32
#   bash benchmarks/peer_session.sh image-checks   # images-check, then vlm-2b-check
#   bash benchmarks/peer_session.sh moe-check [tune]   # issue 31: the MoE kernel tests and moe_kernel_bench.py bench
#                                                      # (and tune, with the time left)
#   bash benchmarks/peer_session.sh moe-tune [fp8_block bf16]   # the MoE tile tables alone
#                                               # (MOE_TUNE_SHAPES=nano-30b ... moe-tune bf16: Nemotron 3 Nano's)
#   bash benchmarks/peer_session.sh moe         # hyserve: 35B-A3B bf16 and FP8, Next-80B FP8 (dummy weights)
#   bash benchmarks/peer_session.sh moe-vllm    # vLLM (default mode): the same; call again to go on where it stopped
#   bash benchmarks/peer_session.sh moe-profile # hyserve: a 35B-A3B batch-1 decode step profiled, bf16 and FP8
#                                               # (PROFILE_BATCHES=1,32: those batches)
#   bash benchmarks/peer_session.sh moe-2b-check  # moe_check.py: a 2B-active MoE shape, float32 then bf16, against transformers fp32
#   bash benchmarks/peer_session.sh moe-vllm 35b_a3b_fp8 next80b_fp8   # those runs alone (also for moe)
#   bash benchmarks/peer_session.sh moe-agent   # both engines: the agent trace with prefix caching on 35B-A3B bf16
#   bash benchmarks/peer_session.sh moe-spec    # both engines: MTP k = 3 planted at 80 %, batch 1 and 32, 35B-A3B bf16
#   bash benchmarks/peer_session.sh moe-spec vllm   # one engine's run alone (moe-agent too); call again to go on
#   bash benchmarks/peer_session.sh mamba2      # issue 33, hyserve: Nemotron-H-8B and Nemotron 3 Nano 30B-A3B (dummy
#                                               # weights): decode 1/8/32/64, bound, prefill 32 x 2048, agent trace
#   bash benchmarks/peer_session.sh mamba2-vllm # vLLM (default mode): the same; call again to go on where it stopped
#   bash benchmarks/peer_session.sh mamba2 n8b n8b_agent   # those runs alone (mamba2-vllm too)
#   bash benchmarks/peer_session.sh seed        # issue 34: hyserve on the seed's deployment (27B FP8 dummy, images,
#                                               # MTP 2 planted at 80 %, 32 agents; seed_bench.py)
#   bash benchmarks/peer_session.sh profile34 [hyserve|vllm]   # issue 34: a 9B decode step by kernel family in each
#                                               # engine's own profiler, batch 1 and 64 (vLLM's default mode)
#   bash benchmarks/peer_session.sh short-rows  # issue 34: verify rows' attention (split-context kernel): tests, bench
#   bash benchmarks/peer_session.sh verify-fused  # issue 34: the fused GDN verify against the fused decode; CUDA tests
#   bash benchmarks/peer_session.sh seed-vllm   # vLLM (default mode): the same; then here: python
#                                               # benchmarks/seed_bench.py report <both JSON files> --out DIR
#
# Each engine runs in processes of its own (vLLM does not free the GPU within one), each under a timeout; every
# process writes its JSON and log under $OUT. Then, here: python benchmarks/peer_bench.py report <files>; for the
# MoE phases, python benchmarks/peer_bench.py moe-report <their JSON files> --out DIR (one table, both engines).
set -u
OUT=${OUT:?}
MOE_ONLY="${*:2}"  # moe / moe-vllm: the runs to make (all when empty)
MOE_DONE=${MOE_DONE:-/tmp/moe_done}  # the MoE runs done on this warm machine (its /tmp lasts while it is warm)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
VLLM_ENV=(env PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0)
# vLLM as its users run it (../shared/peer/README.md): the engine core in its own process (the variable unset)
VLLM_DEFAULT_ENV=(env PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0)
MTP3='{"method": "mtp", "num_speculative_tokens": 3}'
PB=benchmarks/peer_bench.py

# vLLM's JIT and compile caches (FlashInfer's GDN prefill kernel takes about 8 minutes to build on a fresh machine):
# brought back as $OUT/vllm_caches.tgz.NN (15 MB parts: a file from $OUT comes back only under 16 MiB) and carried
# in as .peer/vllm_caches.tgz.NN by a later session: with the tree they are too large for one call, so a call or
# two before (phase stash-caches, carrying some of the parts each) puts them in /tmp/vllm_caches.
if [ "${1:-}" = stash-caches ]; then
    mkdir -p /tmp/vllm_caches && cp .peer/vllm_caches.tgz.* /tmp/vllm_caches/ && ls -l /tmp/vllm_caches; exit 0
fi
if ls /tmp/vllm_caches/vllm_caches.tgz.* > /dev/null 2>&1 && [ ! -d ~/.cache/flashinfer ]; then
    mkdir -p ~/.cache && cat /tmp/vllm_caches/vllm_caches.tgz.* | tar -C ~/.cache -xzf - && echo "vLLM caches restored"
fi
save_vllm_caches() {
    rm -f "$OUT"/vllm_caches.tgz.*
    (cd ~/.cache && tar -czf - $(ls -d flashinfer vllm 2>/dev/null)) 2>/dev/null | split -b 15000000 -d - "$OUT/vllm_caches.tgz."
    local size
    size=$(cat "$OUT"/vllm_caches.tgz.* 2>/dev/null | wc -c)
    echo "   vLLM caches: $size bytes ($(du -sh ~/.cache/flashinfer 2>/dev/null | cut -f1) flashinfer)"
    [ "$size" -lt 45000000 ] || { echo "   too large to bring back"; rm -f "$OUT"/vllm_caches.tgz.*; }
}
# At most 8 files come back from $OUT: the JSON and logs travel as one archive, beside the cache parts. A profile
# trace over 8 MB is left out of it (it would take the archive past what comes back; its gaps and kernels are in
# the run's JSON).
pack_out() {
    find "$OUT" -maxdepth 1 -name '*_profile.json.gz' -size +8M -printf '   left on the card: %f (%s bytes)\n' \
        -delete
    (cd "$OUT" && tar -czf /tmp/results.tgz --exclude='vllm_caches.tgz.*' . && \
        find . -mindepth 1 -maxdepth 1 ! -name 'vllm_caches.tgz.*' -exec rm -rf {} + && mv /tmp/results.tgz .)
}
trap pack_out EXIT

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
    [ "$engine" = vllm ] && save_vllm_caches
    return 0
}
p2b() { [ -d /tmp/p2b ] || python3 $PB write --shape 2b --out /tmp/p2b > "$OUT/write_2b.log" 2>&1; }
p2bv() {  # the 2B shape with a real-size vision tower, its processor files and a tokenizer (image runs)
    [ -f /tmp/p2bv/tokenizer_config.json ] && return 0
    rm -rf /tmp/p2bv
    echo "== write 2b --vision real ($(date +%T))"
    python3 $PB write --shape 2b --vision real --out /tmp/p2bv > "$OUT/write_2b_vision.log" 2>&1
    echo "   rc $? ($(date +%T))"
}
left() {  # seconds left of this call (600 s, less a margin for packing the results), less $1; at least 30
    local n=$(( 585 - SECONDS - ${1:-0} ))
    [ "$n" -gt 30 ] && echo "$n" || echo 30
}
vllm_warm() {  # FlashInfer's GDN prefill module is built here (restored by stash-caches, or left by an earlier
    # vLLM process): that module itself, not the directory or another module (a Triton-backend run leaves a 16 KB
    # directory, and taking that for warm sent the next run into FlashInfer's 8-minute JIT on 2026-12-03; an FP8
    # run leaves fp8_blockscale_gemm_90.so, which is not the GDN kernel)
    find ~/.cache/flashinfer -name 'gdn_prefill*.so' 2>/dev/null | grep -q .
}
images_check() {
    timeout "$(left 10)" python3 benchmarks/gpu_check.py --images-only --out "$OUT" > "$OUT/gpu_check_images.log" 2>&1
    echo "gpu_check images rc $?"; grep all_correctness_pass "$OUT/gpu_check_images.log"
}
vlm_2b_check() {  # the real-tower 2B (written first if missing) in bf16 with images against transformers in fp32
    p2bv
    timeout "$(left 10)" python3 benchmarks/gpu_check.py --vlm-2b /tmp/p2bv --vlm-2b-only --out "$OUT" \
        > "$OUT/gpu_check_vlm_2b.log" 2>&1
    echo "gpu_check vlm-2b rc $? ($(date +%T))"; grep -E "^2B VLM|all_correctness_pass" "$OUT/gpu_check_vlm_2b.log"
}
p9b() { [ -d /tmp/p9b ] || python3 $PB write --shape 9b --out /tmp/p9b > "$OUT/write_9b.log" 2>&1; }

# Issue 31's MoE shapes: config.json alone (35B-A3B in the VLM form with a toy vision tower and the processor files,
# Next-80B as Qwen3NextForCausalLM, text only), weights made at load by both engines (--load-format dummy); decode at batch 1/8/32/64 after prompts of 512, prefill 32 x 2048, and the
# batch-1 bound over the weights a token reads (its top-k experts). Each phase keeps under 560 s of wall time: a run
# gets what is left of it, and one that finished leaves a mark in /tmp/moe_done (the machine's /tmp lasts while it
# is warm), so calling the phase again goes on with the runs not done yet. Names after the phase run those alone
# (`moe-vllm 35b_a3b_fp8 next80b_fp8` on a fresh machine).
MOE_ARGS=(--measures decode,bound,prefill --load-format dummy --batches 1,8,32,64 --prefill-prompts 32 --prefill-len 2048)
moe_shapes() {
    local spec name dir flag
    for spec in 35b-a3b:/tmp/m35 35b-a3b:/tmp/m35_fp8:--fp8 next-80b:/tmp/m80_fp8:--fp8; do
        IFS=: read -r name dir flag <<< "$spec"
        [ -f "$dir/config.json" ] || python3 benchmarks/shapes.py --shape "$name" --config-only --out "$dir" $flag \
            >> "$OUT/write_moe.log" 2>&1 || { echo "writing $dir failed"; tail -3 "$OUT/write_moe.log"; }
    done
}
within() {  # seconds for the next run: at most $1, and what is left of the phase's 555 s (PHASE_S) less $2 (0: no time)
    local n=$(( ${PHASE_S:-555} - SECONDS - ${2:-0} ))
    [ "$n" -gt "$1" ] && n=$1
    [ "$n" -gt 60 ] && echo "$n" || echo 0
}
moe_run() {  # moe_run ENGINE DIR NAME CAP [ARGS...]: one MoE measure, once per warm machine, within the phase's time
    local engine=$1 dir=$2 name=$3 cap=$4 limit
    shift 4
    mkdir -p "$MOE_DONE"
    if [ -n "${MOE_ONLY:-}" ] && [[ " $MOE_ONLY " != *" $name "* ]]; then return 0; fi
    if [ -f "$MOE_DONE/${engine}_$name" ]; then echo "== $engine $name: done in an earlier call"; return 0; fi
    limit=$(within "$cap" 5)
    if [ "$limit" = 0 ]; then echo "== $engine $name: no time left in this call; run the phase again"; return 0; fi
    local extra=()
    # vLLM's GDN prefill: FlashInfer's where its JIT cache is here, else its Triton kernel (no 8-10 minute JIT;
    # the results file says which)
    [ "$engine" = vllm ] && ! vllm_warm && extra=(--vllm-gdn-prefill-backend triton)
    measure "$engine" "$dir" "$name" "$limit" "${MOE_ARGS[@]}" "${extra[@]}" "$@"
    grep -q '"decode_bs1_tok_s"' "$OUT/${engine}_$name.json" 2>/dev/null && touch "$MOE_DONE/${engine}_$name"
    return 0
}

# Issue 31's agent trace and MTP on the 35B-A3B bf16 shape (/tmp/m35, dummy weights), hyserve then vLLM in its
# default mode, each once per warm machine (marks in /tmp/moe_done; `moe-agent vllm` / `moe-spec hyserve`: one engine).
# What the MTP figure measures: the dummy weights carry no trained head, so each engine's acceptance is drawn.
# hyserve: spec_decode_bench.py --synthetic: a plain engine's decode, then the MTP engine whose head drafts every
# step and whose verify draws each draft token's verdict, true w.p. 0.8 (inside its verify graphs; drafts planted
# from the plain run's outputs stopped matching on 2026-12-03: in bf16 a random MoE model's MTP run parts from the
# plain one within a few tokens, router choices near ties flipping, and only 6 % were accepted).
# vLLM: its synthetic rejection sampling (peer_bench.py synthetic_mtp_config) at the same per-position rates
# 0.8 / 0.64 / 0.512 (acceptance length 2.952): its MTP head drafts, the sampler accepts by the draws. Both at
# prompts of 512 and 128 greedy tokens; compare the speedups over each engine's own plain decode.
MTP3_SYNTH='{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8, 0.64, 0.512]}'
SPEC_MOE_ARGS=(--load-format dummy --device cuda --dtype bfloat16 --gpu-memory-utilization 0.85 --shared-engines
               --synthetic --no-diagnosis --k 3 --rates 0.8 --batches 1,32 --prompt-len 512 --max-tokens 128)
moe_todo() {  # moe_todo ENGINE NAME CAP: the seconds for this run (echo), or nothing when it is not to run now
    local engine=$1 name=$2 limit
    mkdir -p "$MOE_DONE"
    if [ -n "${MOE_ONLY:-}" ] && [[ " $MOE_ONLY " != *" $engine "* ]] && [[ " $MOE_ONLY " != *" $name "* ]]; then
        return 0
    fi
    if [ -f "$MOE_DONE/${engine}_$name" ]; then echo "== $engine $name: done in an earlier call" >&2; return 0; fi
    limit=$(within "$3" 5)
    if [ "$limit" = 0 ]; then echo "== $engine $name: no time left in this call; run the phase again" >&2; return 0; fi
    echo "$limit"
}
moe_done() {  # moe_done ENGINE NAME FILE KEY: mark the run done when FILE holds KEY
    grep -q "\"$4\"" "$3" 2>/dev/null && touch "$MOE_DONE/$1_$2"
    return 0
}
moe_vllm_extra() {  # vLLM's GDN prefill: FlashInfer's where its JIT cache is here, else its Triton kernel
    vllm_warm || echo --vllm-gdn-prefill-backend triton
}

check() {  # the correctness checks every speed change keeps, in the same device session as its figures
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/worker/test_cuda_graphs.py \
        tests/engine/test_async_scheduling.py tests/kernels/test_verify_kernels.py tests/worker/test_device_drafts.py tests/model/test_fp8.py \
        tests/worker/test_fp8_kv.py tests/worker/test_async_verify.py -k "cuda or gpu" \
        > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc $?"; tail -2 "$OUT/gpu_tests.log"
    timeout 400 python3 benchmarks/gpu_check.py --out "$OUT" > "$OUT/gpu_check.log" 2>&1
    echo "gpu_check rc $?"; grep all_correctness_pass "$OUT/gpu_check.log"
}

fp8_ckpts() {  # compressed-tensors FP8 (channel weights, dynamic tokens) and Qwen's block FP8 of the 2B shape
    [ -d /tmp/p2b_ct ] || python3 $PB quantize --src /tmp/p2b --out /tmp/p2b_ct --format ct_dynamic >> "$OUT/quantize.log" 2>&1
    [ -d /tmp/p2b_blk ] || python3 $PB quantize --src /tmp/p2b --out /tmp/p2b_blk --format block >> "$OUT/quantize.log" 2>&1
}
fp8_correctness() {
    fp8_ckpts
    timeout 300 python3 benchmarks/fp8_check.py --bf16 /tmp/p2b --variant ct=/tmp/p2b_ct --variant block=/tmp/p2b_blk \
        --variant kv=/tmp/p2b:fp8 --out "$OUT/fp8_check.json" > "$OUT/fp8_check.log" 2>&1
    echo "fp8_check rc $?"; tail -4 "$OUT/fp8_check.log"
}

case "${1:?phase}" in
  2b)
    p2b
    measure hyserve /tmp/p2b 2b 200 --measures decode,bound,prefill
    measure hyserve /tmp/p2b 2b_agent 120 --measures agent
    measure hyserve /tmp/p2b 2b_agent_mtp 120 --measures agent --speculative-config "$MTP3"
    measure vllm /tmp/p2b 2b 560 --measures decode,bound,prefill
    ;;
  vllm-first)  # vLLM's first process on the machine compiles for minutes on the CPU: the GPU checks run meanwhile
    p2b
    check > "$OUT/check_summary.log" 2>&1 &
    measure vllm /tmp/p2b 2b_agent 570 --measures agent
    wait; cat "$OUT/check_summary.log"
    ;;
  vllm-agent)  # vLLM's agent trace alone (its first process on a machine compiles for about 8 minutes)
    p2b
    measure vllm /tmp/p2b 2b_agent 585 --measures agent
    ;;
  first)  # vLLM's first process (compiling on the CPU for minutes) on the agent trace; meanwhile, the GPU checks,
           # FP8 against bf16 where bf16 is sure, and hyserve's agent-trace hit rates (their walls not comparable)
    p2b
    ( check; fp8_correctness; measure hyserve /tmp/p2b 2b_agent_bg 120 --measures agent
      measure hyserve /tmp/p2b 2b_agent_kvfp8_bg 120 --measures agent --kv-cache-dtype fp8 ) > "$OUT/check_summary.log" 2>&1 &
    # vLLM's first compile took 463 s on 2026-12-01 and more than 575 s on 2026-12-02: the whole call is its
    measure vllm /tmp/p2b 2b_agent 590 --measures agent
    wait; cat "$OUT/check_summary.log"
    ;;
  fp8)  # FP8 GEMM kernels at the layers' shapes; hyserve decode and prefill, bf16 against the FP8 checkpoints
    p2b; fp8_ckpts
    timeout 200 python3 benchmarks/fp8_gemm_bench.py --out "$OUT/fp8_gemm.json" --budget-s 150 > "$OUT/fp8_gemm.log" 2>&1
    echo "fp8_gemm rc $?"; tail -2 "$OUT/fp8_gemm.log"
    measure hyserve /tmp/p2b 2b 100 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_ct 2b_ct 100 --measures decode,bound,prefill
    HYSERVE_FP8_GEMM=triton measure hyserve /tmp/p2b_ct 2b_ct_triton 100 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_blk 2b_blk 100 --measures decode,bound,prefill
    ;;
  fp8-check) p2b; fp8_correctness ;;
  fp8-9b)  # the 9B shape in compressed-tensors FP8: against its bf16 self where bf16 is sure, then decode and prefill
    p9b
    [ -d /tmp/p9b_ct ] || python3 $PB quantize --src /tmp/p9b --out /tmp/p9b_ct --format ct_dynamic >> "$OUT/quantize.log" 2>&1
    timeout 240 python3 benchmarks/fp8_check.py --bf16 /tmp/p9b --variant ct=/tmp/p9b_ct --out "$OUT/fp8_check_9b.json" \
        > "$OUT/fp8_check_9b.log" 2>&1
    echo "fp8_check rc $?"; tail -2 "$OUT/fp8_check_9b.log"
    measure hyserve /tmp/p9b_ct 9b_ct 200 --measures decode,bound,prefill
    ;;
  fp8-measure)  # hyserve decode and prefill: bf16 against both FP8 checkpoints (the FP8 GEMM choice at its default)
    p2b; fp8_ckpts
    measure hyserve /tmp/p2b 2b 110 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_ct 2b_ct 130 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_blk 2b_blk 130 --measures decode,bound,prefill
    ;;
  fp8-vllm)  # vLLM on the same compressed-tensors FP8 checkpoint, and the agent trace with its FP8 KV cache
    p2b; fp8_ckpts
    measure vllm /tmp/p2b_ct 2b_ct 300 --measures decode,bound,prefill
    measure vllm /tmp/p2b 2b_agent_kvfp8 250 --measures agent --kv-cache-dtype fp8
    ;;
  kvfp8)  # the agent trace with the FP8 KV cache, both engines (vLLM doubles its attention block; hyserve's stays 16)
    p2b
    measure hyserve /tmp/p2b 2b_agent_kvfp8 150 --measures agent --kv-cache-dtype fp8
    measure vllm /tmp/p2b 2b_agent_kvfp8 300 --measures agent --kv-cache-dtype fp8
    ;;
  vllm-start)  # vLLM's start with its compile caches warm
    p2b
    measure vllm /tmp/p2b 2b_start 150 --measures start
    ;;
  vllm-rest)
    p2b
    measure vllm /tmp/p2b 2b_agent_mtp 180 --measures agent --speculative-config "$MTP3"
    measure vllm /tmp/p2b 2b_start 150 --measures start
    ;;
  2b-vllm-agent)
    p2b
    measure vllm /tmp/p2b 2b_agent 570 --measures agent
    measure vllm /tmp/p2b 2b_agent_mtp 180 --measures agent --speculative-config "$MTP3"
    ;;
  9b)
    p9b
    measure hyserve /tmp/p9b 9b 200 --measures decode,bound,prefill
    measure hyserve /tmp/p9b 9b_start 120 --measures start
    ;;
  9b-profile)  # where a 9B batch-1 decode step goes (kernels by name, host time), for the bound goal
    p9b
    timeout 300 python3 benchmarks/profile_step.py --model /tmp/p9b --device cuda --dtype bfloat16 --batch 1 \
        --out "$OUT/profile_9b" > "$OUT/profile_9b.log" 2>&1
    echo "profile rc $?"; tail -5 "$OUT/profile_9b.log"
    ;;
  9b-vllm)
    p9b
    measure vllm /tmp/p9b 9b 400 --measures decode,bound,prefill
    ;;
  9b-all)  # hyserve's 9B figures and where its batch-1 step goes
    p9b
    measure hyserve /tmp/p9b 9b 200 --measures decode,bound,prefill
    timeout 200 python3 benchmarks/profile_step.py --model /tmp/p9b --device cuda --dtype bfloat16 --batch 1 \
        --out "$OUT/profile_9b" > "$OUT/profile_9b.log" 2>&1
    echo "profile rc $?"; tail -5 "$OUT/profile_9b.log"
    ;;
  9b-both)  # vLLM's 9B figures, then hyserve's, in one call (vLLM's compile caches warm from an earlier call)
    p9b
    measure vllm /tmp/p9b 9b 370 --measures decode,bound,prefill
    measure hyserve /tmp/p9b 9b 200 --measures decode,bound,prefill
    ;;
  profile-fp8)  # where hyserve's 9B batch-1 step goes; then bf16 against both FP8 checkpoints of the 2B shape
    p9b; p2b; fp8_ckpts
    timeout 150 python3 benchmarks/profile_step.py --model /tmp/p9b --device cuda --dtype bfloat16 --batch 1 \
        --out "$OUT/profile_9b" > "$OUT/profile_9b.log" 2>&1
    echo "profile rc $?"; tail -5 "$OUT/profile_9b.log"
    measure hyserve /tmp/p2b 2b 110 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_ct 2b_ct 120 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_blk 2b_blk 120 --measures decode,bound,prefill
    ;;
  fp8-ct)  # hyserve on the compressed-tensors FP8 checkpoints of both shapes (bf16's figures from an earlier phase)
    p2b; p9b
    [ -d /tmp/p2b_ct ] || python3 $PB quantize --src /tmp/p2b --out /tmp/p2b_ct --format ct_dynamic >> "$OUT/quantize.log" 2>&1
    measure hyserve /tmp/p2b_ct 2b_ct 100 --measures decode,bound,prefill
    [ -d /tmp/p9b_ct ] || python3 $PB quantize --src /tmp/p9b --out /tmp/p9b_ct --format ct_dynamic >> "$OUT/quantize.log" 2>&1
    measure hyserve /tmp/p9b_ct 9b_ct 100 --measures decode,bound,prefill
    ;;
  images)  # the seed's screenshot agent trace (2 x 1280x720 per request, 880 placeholders each) on the real-tower 2B
           # shape: hyserve at 8 and 32 conversations, then the real-tower 2B VLM against transformers with the time
           # left. No vLLM here: the vLLM side is images-vllm, in a call of its own after the bring-up.
    p2bv
    measure hyserve /tmp/p2bv 2b_agent_images 150 --measures agent_images
    measure hyserve /tmp/p2bv 2b_agent_images_c32 240 --measures agent_images --agent-concurrency 32
    vlm_2b_check
    ;;
  images-hyserve)  # images without the 2B VLM check: hyserve's screenshot trace at 8 and 32 conversations
    p2bv
    measure hyserve /tmp/p2bv 2b_agent_images 150 --measures agent_images
    measure hyserve /tmp/p2bv 2b_agent_images_c32 "$(left 5)" --measures agent_images --agent-concurrency 32
    ;;
  images-vllm)  # vLLM on the screenshot trace (its Triton/FLA GDN prefill kernel: no FlashInfer JIT): 8
                # conversations, then 32 in a second process with its compile caches warm
    p2bv
    measure vllm /tmp/p2bv 2b_agent_images "$(left 200)" --measures agent_images --vllm-gdn-prefill-backend triton
    if [ "$(left)" -gt 150 ]; then
        measure vllm /tmp/p2bv 2b_agent_images_c32 "$(left 5)" --measures agent_images --agent-concurrency 32 \
            --vllm-gdn-prefill-backend triton
    else
        echo "no time left for 32 conversations: images-vllm32"
    fi
    ;;
  images-vllm32)  # vLLM at 32 conversations alone (when images-vllm's first process took the call)
    p2bv
    measure vllm /tmp/p2bv 2b_agent_images_c32 "$(left 5)" --measures agent_images --agent-concurrency 32 \
        --vllm-gdn-prefill-backend triton
    ;;
  images-check) images_check ;;
  vlm-2b-check) vlm_2b_check ;;
  image-checks) images_check; vlm_2b_check ;;  # both image checks, one call
  check) check ;;
  spec)  # fixed k ("adaptive": false; the adaptive phase below measures the per-step choice)
    measure hyserve hyserve/default_model packaged_spec 150 --measures spec --spec-batches 1,8 --max-model-len 4096 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}'
    [ -d /tmp/mtp2b ] || python3 benchmarks/shapes.py --shape 2b --mtp --init stable --out /tmp/mtp2b > /dev/null 2>&1
    # rows behind rows in flight, and verify rows that wait for their counts (whole steps enqueued), same call
    for variant in "" --no-rows-behind; do
        name=spec_mtp2b${variant:+_no_behind}
        timeout 200 python3 benchmarks/spec_decode_bench.py --model /tmp/mtp2b --device cuda --dtype bfloat16 \
            --out "$OUT/$name" --max-tokens 64 --rates 0.8 --batches 1,32 $variant > "$OUT/$name.log" 2>&1
        echo "$name rc $?"; tail -4 "$OUT/$name.log"
    done
    ;;
  adaptive-off|adaptive-on)  # issue 34: the 2B shape's planted head at k = 3, fixed or chosen per step
    [ -d /tmp/mtp2b ] || python3 benchmarks/shapes.py --shape 2b --mtp --init stable --out /tmp/mtp2b > /dev/null 2>&1
    name=adaptive_mtp2b_${1#adaptive-}
    timeout 500 python3 benchmarks/spec_decode_bench.py --model /tmp/mtp2b --device cuda --dtype bfloat16 \
        --out "$OUT/$name" --max-tokens 128 --rates 0.8,0 --batches 1,8,32,64 --shared-engines \
        --adaptive "${1#adaptive-}" > "$OUT/$name.log" 2>&1
    echo "$name rc $?"; tail -10 "$OUT/$name.log"
    ;;
  adaptive-packaged)  # issue 34: the packaged model's trained head at k = 3, fixed then per step, each against plain
    for mode in false true; do
        measure hyserve hyserve/default_model packaged_adaptive_$mode 200 --measures spec --spec-batches 1,8,32,64 \
            --max-model-len 4096 \
            --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": 3, \"adaptive\": $mode}"
    done
    ;;
  # Issue 15's last H200 figures in three calls after the bring-up, vLLM with its Triton/FLA GDN prefill kernel
  # (--vllm-gdn-prefill-backend triton: no 8-10 minute FlashInfer JIT; decode steps take neither kernel).
  fp8-a)  # the FP8 CUDA tests; hyserve bf16 / compressed-tensors / block FP8 on the 2B shape; vLLM on the same FP8
    p2b; fp8_ckpts
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8.py tests/worker/test_fp8_kv.py tests/kernels/test_kernels.py \
        -k "cuda or gpu" > "$OUT/gpu_tests_fp8.log" 2>&1
    echo "gpu fp8 tests rc $? ($(date +%T))"; tail -2 "$OUT/gpu_tests_fp8.log"
    measure hyserve /tmp/p2b 2b 110 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_ct 2b_ct 110 --measures decode,bound,prefill
    measure hyserve /tmp/p2b_blk 2b_blk 110 --measures decode,bound,prefill
    measure vllm /tmp/p2b_ct 2b_ct "$(left 5)" --measures decode,bound,prefill --vllm-gdn-prefill-backend triton
    ;;
  fp8-c)  # the first calls' hyserve figures again (a CUDA fix), and the agent trace with the FP8 KV cache, both engines
    p2b; fp8_ckpts
    measure hyserve /tmp/p2b_ct 2b_ct 100 --measures decode,bound,prefill
    measure hyserve /tmp/p2b 2b 100 --measures decode,bound,prefill
    measure vllm /tmp/p2b 2b_agent_kvfp8 "$(left 160)" --measures agent --kv-cache-dtype fp8 --vllm-gdn-prefill-backend triton
    measure hyserve /tmp/p2b 2b_agent_kvfp8 70 --measures agent --kv-cache-dtype fp8
    [ "$(left)" -gt 80 ] && measure hyserve /tmp/p2b_blk 2b_blk "$(left 5)" --measures decode,bound,prefill
    ;;
  fp8-b)  # the agent trace with the FP8 KV cache, both engines; FP8 against bf16 where bf16 is sure; vLLM bf16
    p2b; fp8_ckpts
    measure vllm /tmp/p2b 2b_agent_kvfp8 200 --measures agent --kv-cache-dtype fp8 --vllm-gdn-prefill-backend triton
    measure hyserve /tmp/p2b 2b_agent_kvfp8 90 --measures agent --kv-cache-dtype fp8
    measure hyserve /tmp/p2b 2b_agent 90 --measures agent
    fp8_correctness
    measure vllm /tmp/p2b 2b "$(left 5)" --measures decode,bound,prefill --vllm-gdn-prefill-backend triton
    ;;
  fp8-9b2)  # the 9B shape: compressed-tensors FP8 against its bf16 self where bf16 is sure, then both decoding
    p9b
    [ -d /tmp/p9b_ct ] || python3 $PB quantize --src /tmp/p9b --out /tmp/p9b_ct --format ct_dynamic >> "$OUT/quantize.log" 2>&1
    echo "9B written and quantized ($(date +%T))"
    measure hyserve /tmp/p9b_ct 9b_ct 110 --measures decode,bound,prefill
    measure hyserve /tmp/p9b 9b 110 --measures decode,bound,prefill
    timeout "$(left 5)" python3 benchmarks/fp8_check.py --bf16 /tmp/p9b --variant ct=/tmp/p9b_ct \
        --out "$OUT/fp8_check_9b.json" > "$OUT/fp8_check_9b.log" 2>&1
    echo "fp8_check 9b rc $?"; tail -2 "$OUT/fp8_check_9b.log"
    ;;
  moe-check)  # the MoE kernels and families on CUDA: their tests, then the kernels' benchmark
    if [ -f tests/kernels/test_moe_kernels.py ]; then
        timeout "$(within 300)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_kernels.py \
            tests/model/test_qwen3_5_moe.py tests/model/test_fp8_moe.py tests/model/test_qwen3_next.py \
            tests/model/test_fp8_qwen3_next.py tests/model/test_ssm_state_dtype.py -k cuda \
            > "$OUT/moe_kernel_tests.log" 2>&1
        echo "moe CUDA tests rc $? ($(date +%T))"; tail -3 "$OUT/moe_kernel_tests.log"
    else
        echo "tests/kernels/test_moe_kernels.py is not in this tree"
    fi
    # cuBLASLt's block-scaled FP8 GEMM (HYSERVE_FP8_GEMM=scaled_mm on block weights): its tests, then its speed
    # beside the Triton kernel at the 2B layers' shapes (the 35B-A3B's attention and GDN projections)
    timeout "$(within 90 300)" python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8.py \
        -k "blockwise or cuda_scaled_mm" > "$OUT/fp8_blockwise_tests.log" 2>&1
    echo "fp8 blockwise tests rc $?"; tail -1 "$OUT/fp8_blockwise_tests.log"
    timeout "$(within 120 300)" python3 benchmarks/fp8_gemm_bench.py --shapes 2b --no-sweep \
        --out "$OUT/fp8_gemm_block.json" > "$OUT/fp8_gemm_block.log" 2>&1
    echo "fp8_gemm_bench rc $?"; tail -2 "$OUT/fp8_gemm_block.log"
    if [ -f benchmarks/moe_kernel_bench.py ]; then  # one layer's routed experts at both shapes, every dtype
        timeout "$(within 400 10)" python3 benchmarks/moe_kernel_bench.py bench --shapes 35b-a3b next-80b \
            --out "$OUT/moe_kernels.json" > "$OUT/moe_kernel_bench.log" 2>&1
        echo "moe_kernel_bench rc $? ($(date +%T))"; tail -15 "$OUT/moe_kernel_bench.log"
        timeout "$(within 120 10)" python3 benchmarks/moe_kernel_bench.py shared --tokens 1 8 32 64 \
            --out "$OUT/moe_shared.json" > "$OUT/moe_shared.log" 2>&1
        echo "moe_kernel_bench shared rc $? ($(date +%T))"; tail -4 "$OUT/moe_shared.log"
        if [[ " $MOE_ONLY " == *" tune "* ]] && [ "$(within 600 10)" -gt 120 ]; then  # `moe-check tune`: the tile
            # tables too, with the time left (copy them into the repository)
            timeout "$(within 600 10)" python3 benchmarks/moe_kernel_bench.py tune --dtypes fp8_block bf16 \
                --out "$OUT/moe_configs" \
                > "$OUT/moe_kernel_tune.log" 2>&1
            echo "moe_kernel_bench tune rc $? ($(date +%T))"; tail -3 "$OUT/moe_kernel_tune.log"
        fi
    else
        echo "benchmarks/moe_kernel_bench.py is not in this tree"
    fi
    ;;
  moe-tune)  # the tile tables alone (`moe-tune fp8_block bf16`: those dtypes, in that order; each table is written
    # after every token count, so a cut run leaves the counts done); copy moe_configs/*.json into the repository
    # MOE_TUNE_SHAPES: moe_kernel_bench.py's shapes (default 35b-a3b; nano-30b: Nemotron 3 Nano's relu2 experts)
    timeout "$(within 600 10)" python3 benchmarks/moe_kernel_bench.py tune --shapes ${MOE_TUNE_SHAPES:-35b-a3b} \
        --dtypes ${MOE_ONLY:-fp8_block bf16} --out "$OUT/moe_configs" > "$OUT/moe_kernel_tune.log" 2>&1
    echo "moe_kernel_bench tune rc $? ($(date +%T))"; grep -c best_us "$OUT/moe_kernel_tune.log"; tail -2 "$OUT/moe_kernel_tune.log"
    ;;
  moe)  # hyserve on the MoE shapes: 35B-A3B in bf16 (64.6 GiB of weights) and block FP8, Next-80B's shape in FP8
    moe_shapes
    moe_run hyserve /tmp/m35 35b_a3b 240
    moe_run hyserve /tmp/m35_fp8 35b_a3b_fp8 200
    if [[ " $MOE_ONLY " == *" 35b_a3b_bf16state "* ]]; then  # named only: the GDN state in bf16, as vLLM keeps it
        moe_run hyserve /tmp/m35 35b_a3b_bf16state 240 --mamba-ssm-cache-dtype bfloat16
    fi
    if [[ " $MOE_ONLY " == *" 35b_a3b_fp8_scaled_mm "* ]]; then  # named only: cuBLASLt for every FP8 GEMM
        (export HYSERVE_FP8_GEMM=scaled_mm; moe_run hyserve /tmp/m35_fp8 35b_a3b_fp8_scaled_mm 200)
    fi
    moe_run hyserve /tmp/m80_fp8 next80b_fp8 300
    ;;
  qwen4)  # issue 32: hyserve on a Qwen4-Exp shape in block FP8 (shapes.py SHAPE_QWEN4_EXP, dummy weights), prefix
    # caching on: decode at batch 1/8/32, the bound, prefill 32 x 2048; then MTP k = 4 drawn at 80 % at batch 1, 8
    # and 32 (spec_decode_bench.py --synthetic, as moe-spec; 0.92 of the card: at 0.85 the 98 GB of weights left room
    # for 15 rows of recurrent state and 5 verify candidates each). vLLM 0.24 has no qwen4_exp: hyserve alone.
    [ -f /tmp/q4_fp8/config.json ] || python3 benchmarks/shapes.py --shape qwen4-exp --config-only --fp8 \
        --out /tmp/q4_fp8 >> "$OUT/write_moe.log" 2>&1 || { echo "writing /tmp/q4_fp8 failed"; tail -3 "$OUT/write_moe.log"; }
    moe_run hyserve /tmp/q4_fp8 qwen4_exp_fp8 300 --prefix-caching --batches 1,8,32
    limit=$(moe_todo hyserve qwen4_exp_fp8_spec 300)
    if [ -n "$limit" ]; then
        echo "== hyserve qwen4_exp_fp8_spec ($(date +%T))"
        timeout "$limit" python3 benchmarks/spec_decode_bench.py --model /tmp/q4_fp8 --load-format dummy --device cuda \
            --dtype bfloat16 --gpu-memory-utilization 0.92 --shared-engines --synthetic --no-diagnosis --k 4 \
            --rates 0.8 --batches 1,8,32 --prompt-len 512 --max-tokens 128 --prefix-caching \
            --out "$OUT/hyserve_qwen4_exp_fp8_spec" > "$OUT/hyserve_qwen4_exp_fp8_spec.log" 2>&1
        echo "   rc $? ($(date +%T))"
        tail -4 "$OUT/hyserve_qwen4_exp_fp8_spec.log"
        moe_done hyserve qwen4_exp_fp8_spec "$OUT/hyserve_qwen4_exp_fp8_spec/spec_decode.json" rows
    fi
    ;;
  moe-2b-check)  # issue 31's check on the card: a 2B-active MoE shape against transformers float32, the engine in
    # bf16 (beside transformers' own bf16 model), then float32 (IEEE dots: the kernels' arithmetic); MOE_CHECK_DTYPES
    # picks (the reference's GDN on transformers' PyTorch functions either way)
    for dt in ${MOE_CHECK_DTYPES:-bfloat16 float32}; do
        mkdir -p "$OUT/moe_check_$dt"
        timeout "$(within 300 5)" python3 benchmarks/moe_check.py --dtype $dt --out "$OUT/moe_check_$dt" \
            > "$OUT/moe_check_$dt/moe_check.log" 2>&1
        echo "moe_check $dt rc $? ($(date +%T))"; grep -E "done \(|vs transformers" "$OUT/moe_check_$dt/moe_check.log"
    done
    ;;
  moe-profile)  # where a 35B-A3B decode step goes (bf16, then block FP8): kernels by name, launches; at batch 1,
    # or at the batches of PROFILE_BATCHES (PROFILE_BATCHES=1,32: where vLLM leads at 32 too); PROFILE_SHAPES picks
    # (35b_a3b, 35b_a3b_fp8; qwen4_exp_fp8: issue 32's shape, named only), PROFILE_EXTRA adds engine arguments ('"mamba_ssm_cache_dtype": "bfloat16"'),
    # PROFILE_PROMPT_LEN the prompts (128; the decode figures' 512)
    # PROFILE_PREFILL=32 (with PROFILE_PROMPT_LEN=2048): a prefill of that many prompts instead of decode steps
    moe_shapes
    pb=${PROFILE_BATCHES:-1}
    tag=bs${pb//,/_}
    pre=()
    if [ -n "${PROFILE_PREFILL:-}" ]; then tag=prefill${PROFILE_PREFILL}x${PROFILE_PROMPT_LEN:-128}; pre=(--prefill-prompts "$PROFILE_PREFILL"); fi
    if [[ " ${PROFILE_SHAPES:-} " == *" qwen4_exp_fp8 "* ]] && [ ! -f /tmp/q4_fp8/config.json ]; then
        python3 benchmarks/shapes.py --shape qwen4-exp --config-only --fp8 --out /tmp/q4_fp8 >> "$OUT/write_moe.log" 2>&1
    fi
    for spec in 35b_a3b:/tmp/m35 35b_a3b_fp8:/tmp/m35_fp8 qwen4_exp_fp8:/tmp/q4_fp8; do
        IFS=: read -r name dir <<< "$spec"
        [[ " ${PROFILE_SHAPES:-35b_a3b 35b_a3b_fp8} " == *" $name "* ]] || continue
        timeout "$(within 250 5)" python3 benchmarks/profile_step.py --model "$dir" --device cuda --dtype bfloat16 \
            --batch "$pb" --prompt-len "${PROFILE_PROMPT_LEN:-128}" "${pre[@]}" \
            --extra "{\"load_format\": \"dummy\"${PROFILE_EXTRA:+, $PROFILE_EXTRA}}" \
            --out "$OUT/profile_${name}_$tag" > "$OUT/profile_${name}_$tag.log" 2>&1
        echo "profile $name rc $? ($(date +%T))"; grep -E "ms/step|^prefill" "$OUT/profile_${name}_$tag.log"
    done
    ;;
  moe-vllm)  # vLLM in its default mode on the same directories (load_format dummy, no images); its
             # first process compiles for minutes, so this phase may take two or three calls
    moe_shapes
    VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}")
    moe_run vllm /tmp/m35 35b_a3b 550
    moe_run vllm /tmp/m35_fp8 35b_a3b_fp8 550
    moe_run vllm /tmp/m80_fp8 next80b_fp8 550
    if [[ " $MOE_ONLY " == *" 35b_a3b_fp32state "* ]]; then  # named only: vLLM with hyserve's float32 GDN state
        moe_run vllm /tmp/m35 35b_a3b_fp32state 550 --mamba-ssm-cache-dtype float32
    fi
    ;;
  moe-agent)  # the agent trace (8 conversations x 4 turns, 1.7k shared prefix, prefix caching) on 35B-A3B bf16:
              # hyserve (dummy load ~80 s, then seconds), then vLLM in its default mode with the time left
    moe_shapes
    VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}")
    limit=$(moe_todo hyserve 35b_a3b_agent 200)
    if [ -n "$limit" ]; then
        measure hyserve /tmp/m35 35b_a3b_agent "$limit" --measures agent --load-format dummy
        moe_done hyserve 35b_a3b_agent "$OUT/hyserve_35b_a3b_agent.json" agent_wall_s
    fi
    limit=$(moe_todo vllm 35b_a3b_agent 550)
    if [ -n "$limit" ]; then
        # shellcheck disable=SC2046
        measure vllm /tmp/m35 35b_a3b_agent "$limit" --measures agent --load-format dummy $(moe_vllm_extra)
        moe_done vllm 35b_a3b_agent "$OUT/vllm_35b_a3b_agent.json" agent_wall_s
    fi
    ;;
  moe-spec)  # MTP k = 3 drawn at 80 % at batch 1 and 32 on 35B-A3B bf16 (see MTP3_SYNTH above): hyserve
             # (two engine starts of ~80 s), then vLLM (a plain and an MTP engine) with the time left
    moe_shapes
    VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}")
    limit=$(moe_todo hyserve 35b_a3b_spec 320)
    if [ -n "$limit" ]; then
        echo "== hyserve 35b_a3b_spec ($(date +%T))"
        timeout "$limit" python3 benchmarks/spec_decode_bench.py --model /tmp/m35 "${SPEC_MOE_ARGS[@]}" \
            --out "$OUT/hyserve_35b_a3b_spec" > "$OUT/hyserve_35b_a3b_spec.log" 2>&1
        echo "   rc $? ($(date +%T))"
        tail -4 "$OUT/hyserve_35b_a3b_spec.log"
        moe_done hyserve 35b_a3b_spec "$OUT/hyserve_35b_a3b_spec/spec_decode.json" rows
    fi
    limit=$(moe_todo vllm 35b_a3b_spec 550)
    if [ -n "$limit" ]; then
        # shellcheck disable=SC2046
        measure vllm /tmp/m35 35b_a3b_spec "$limit" --measures spec --load-format dummy --spec-batches 1,32 \
            --speculative-config "$MTP3_SYNTH" $(moe_vllm_extra)
        moe_done vllm 35b_a3b_spec "$OUT/vllm_35b_a3b_spec.json" spec_speedup_bs32
    fi
    ;;
  mamba2|mamba2-vllm)
    # Issue 33: Nemotron-H-8B (dense: 24 Mamba2, 24 MLP, 4 attention blocks) and Nemotron 3 Nano 30B-A3B (23 Mamba2,
    # 23 MoE blocks of 128 experts top 6, 6 attention) in bf16, config.json alone (shapes.py MAMBA2_SHAPES, the
    # releases' fields), weights made at load by both engines (--load-format dummy). Per shape two runs, each a process
    # of its own: NAME (decode at batch 1/8/32/64 after prompts of 512, the batch-1 bound, prefill 32 x 2048) and
    # NAME_agent (the agent trace, 8 conversations x 4 turns sharing a 1.7k prefix, prefix caching on). Runs done on
    # this warm machine are marked in $MOE_DONE; names after the phase run those alone (n8b n8b_agent n30 n30_agent).
    #
    # vLLM as its users run these models (vLLM 0.24's sources, read from the bundle): NemotronHForCausalLM is native
    # (no --trust-remote-code: the config has no auto_map; model_type nemotron_h is transformers' NemotronHConfig);
    # default mode (engine core in its own process); --enable-prefix-caching alone for the agent trace: NemotronH
    # implements SupportsMambaPrefixCaching, so vLLM picks mamba_cache_mode "all" (Mamba states kept at every block
    # boundary; "align", what the Qwen GDN runs use, is its fallback for models without it) and forces the attention
    # block up to hold one Mamba state's page, rounded to the chunk size (128): SSM state float32 + conv state bf16 =
    # 4,255,744 B on the 8B (128 x 64 x 128 x 4 + 10,240 x 3 x 2) over 4,096 B of K and V a token and layer (8 heads
    # of 128) -> 1,152-token blocks; 2,134,016 B on the Nano over 1,024 B (2 KV heads) -> 2,176-token blocks, longer
    # than the trace's 1.7k shared prefix (its log says "Setting attention block size to N tokens"; the results
    # file records the front end's cache settings, vllm_cache*). The SSM state: vLLM's NemotronH rule takes
    # config.json's mamba_ssm_cache_dtype (the Nano release: float32), else float32: --mamba-ssm-cache-dtype float32
    # (the name NVIDIA's model cards pass to vLLM) is passed to both engines so that both files say so. No GDN layers:
    # --vllm-gdn-prefill-backend does not apply.
    for spec in nemotron-h-8b:/tmp/n8b nemotron3-nano-30b-a3b:/tmp/n30; do
        IFS=: read -r name dir <<< "$spec"
        [ -f "$dir/config.json" ] || python3 benchmarks/shapes.py --shape "$name" --config-only --out "$dir" \
            >> "$OUT/write_mamba2.log" 2>&1 || { echo "writing $dir failed"; tail -3 "$OUT/write_mamba2.log"; }
    done
    engine=hyserve
    if [ "$1" = mamba2-vllm ]; then engine=vllm; VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}"); fi
    M2_ARGS=(--load-format dummy --mamba-ssm-cache-dtype float32)
    M2_MAIN=(--measures decode,bound,prefill --batches 1,8,32,64 --prefill-prompts 32 --prefill-len 2048)
    caps=(240 150 300 200)  # hyserve: n8b, n8b_agent, n30, n30_agent (dummy load and graph capture, then the runs)
    [ "$engine" = vllm ] && caps=(550 400 550 400)  # vLLM's first process compiles and captures for minutes
    i=0
    for spec in n8b:/tmp/n8b n30:/tmp/n30; do
        IFS=: read -r name dir <<< "$spec"
        for run in "$name" "${name}_agent"; do
            cap=${caps[$i]}; i=$((i + 1))
            if [[ "$run" == *_agent ]]; then args=(--measures agent); key=agent_wall_s; else args=("${M2_MAIN[@]}"); key=decode_bs1_tok_s; fi
            limit=$(moe_todo "$engine" "$run" "$cap")
            [ -n "$limit" ] || continue
            measure "$engine" "$dir" "$run" "$limit" "${M2_ARGS[@]}" "${args[@]}"
            moe_done "$engine" "$run" "$OUT/${engine}_$run.json" "$key"
            if [ "$engine" = vllm ]; then  # the block size vLLM forced, its mamba cache mode
                grep -h "Setting attention block size\|Mamba cache mode is set" "$OUT/${engine}_$run.log" 2>/dev/null | tail -2
            fi
        done
    done
    true
    ;;
  seed|seed-vllm)
    # Issue 34, item 1: the seed's own deployment (benchmarks/seed_bench.py): Qwen3.5-27B's shape with the 27B
    # class's vision tower and an MTP layer, compressed-tensors FP8_DYNAMIC, config.json alone (both engines make
    # the weights at load: --load-format dummy), the report's `vllm serve` flags parsed by each engine's own parser,
    # MTP k = 2 with each draft token accepted w.p. 0.8 (hyserve's verify draws, vLLM's synthetic rejection
    # sampling at 0.8 / 0.64), the GUI-agent trace: 32 agents in a closed loop, 256 requests of 4k-11k tokens with
    # 1-3 screenshots of 1280x720 and answers of 20-100 tokens, after a warm-up of 32 first steps. One process per
    # engine, marked done in $MOE_DONE (a call after a cut run starts it again). vLLM's GDN prefill: FlashInfer's
    # where its JIT cache is here, else its Triton kernel (the flags in the results file say which).
    # SEED_ARGS: more seed_bench.py measure arguments (e.g. --requests 128, or --k 0: MTP off); SEED_NAME: the run's
    # name (default seed; another name for another variant, e.g. SEED_NAME=seed_nomtp SEED_ARGS="--k 0");
    # SEED_ENGINE_FLAGS: engine flags after the seed's, as one argument (e.g. "--mamba-ssm-cache-dtype auto");
    # SEED_CAP: the run's cap in seconds (no request is submitted after the cap less 40 s: a slow run ends with
    # fewer requests, cut_by_time_limit true in its file, instead of being killed with nothing written; it is not
    # marked done, so the next call runs it again, with warm compile caches).
    if [ ! -f /tmp/s27/tokenizer.json ]; then
        rm -rf /tmp/s27
        python3 $PB write --shape 27b --vision 27b --fp8 ct_dynamic --no-weights --device cpu --out /tmp/s27 \
            > "$OUT/write_s27.log" 2>&1 || { echo "writing /tmp/s27 failed"; tail -3 "$OUT/write_s27.log"; }
    fi
    engine=hyserve name=${SEED_NAME:-seed}
    pre=()
    if [ "$1" = seed-vllm ]; then engine=vllm; pre=("${VLLM_DEFAULT_ENV[@]}"); fi
    limit=$(moe_todo "$engine" "$name" "${SEED_CAP:-560}")
    if [ -n "$limit" ]; then
        extra=()
        [ "$engine" = vllm ] && ! vllm_warm && extra=(--gdn-prefill-backend triton)
        echo "== $engine $name ($(date +%T), cap $limit s)"
        # shellcheck disable=SC2086
        [ -n "${SEED_ENGINE_FLAGS:-}" ] && extra+=(--engine-flags "$SEED_ENGINE_FLAGS")
        "${pre[@]}" timeout "$limit" python3 benchmarks/seed_bench.py measure --engine "$engine" --model /tmp/s27 \
            --out "$OUT/${engine}_$name.json" --time-limit $((limit - 40)) "${extra[@]}" ${SEED_ARGS:-} \
            > "$OUT/${engine}_$name.log" 2>&1
        echo "   rc $? ($(date +%T))"
        tail -3 "$OUT/${engine}_$name.log"
        if [ "$engine" = vllm ]; then
            grep -h "Setting attention block size\|Mamba cache mode is set\|GPU KV cache size" \
                "$OUT/${engine}_$name.log" 2>/dev/null | tail -3
            save_vllm_caches
        fi
        # done when the whole trace ran (a run cut by its time limit has its file, and runs again at the next call)
        grep -q '"cut_by_time_limit": false' "$OUT/${engine}_$name.json" 2>/dev/null && touch "$MOE_DONE/${engine}_$name"
    fi
    true
    ;;
  decode34|decode34-vllm|decode34-split|decode34-layout|decode34-upfront|decode34-persist)
    # Issue 34, item 3: decode at batch 1 / 8 / 32 / 64 and prefill 32 x 2048 on the 9B shape (bf16) and on the
    # seed's 27B shape in compressed-tensors FP8_DYNAMIC (config only, --load-format dummy, /tmp/s27 as the seed
    # phases write it), hyserve at its defaults beside HYSERVE_FP8_FUSED_QUANT=0 (FP8: every GEMM quantizing its own
    # input again) measured in the same call, and both shapes with their GDN state in bf16 as vLLM's default
    # stores it (--mamba-ssm-cache-dtype auto; hyserve keeps float32 unless told): the like-for-like pairs.
    # (HYSERVE_DECODE_GEMM=on ran on 2026-12-05: 0.68x the default at batch 1, left off and no longer run.)
    # decode34-vllm: vLLM's default mode on the same directories. decode34-split: the GDN decode's two launches in
    # the engine, each head walked by one program (HYSERVE_GDN_DECODE_SPLIT=0) against split over its value blocks
    # (=1), the 9B and the 27B FP8 with bf16 states (vLLM's like), decode only. decode34-layout: the GDN state pool
    # stored key-major (HYSERVE_GDN_STATE_LAYOUT=key) against value-major (=value, the default), the same runs.
    # decode34-upfront: the GDN decode's walk as it is (HYSERVE_GDN_DECODE_UPFRONT=0) against its UPFRONT form (=1:
    # every load that waits only on the slot issued first, the norm from registers), the same runs.
    # decode34-persist: the engine without the persistent launch (HYSERVE_GDN_DECODE_PERSIST=0) against its rule
    # (unset: the persistent launch, the UPFRONT walk looping over pairs, the windows rolled after, from 1,024 (row,
    # value head) pairs), the same runs.
    # Each run marked done in $MOE_DONE (a later call goes on where this one stopped).
    p9b
    if [ ! -f /tmp/s27/tokenizer.json ]; then
        rm -rf /tmp/s27
        python3 $PB write --shape 27b --vision 27b --fp8 ct_dynamic --no-weights --device cpu --out /tmp/s27 \
            > "$OUT/write_s27.log" 2>&1 || { echo "writing /tmp/s27 failed"; tail -3 "$OUT/write_s27.log"; }
    fi
    D34_MAIN=(--measures decode,bound,prefill --batches 1,8,32,64 --prefill-prompts 32 --prefill-len 2048)
    D34_DECODE=(--measures decode,bound --batches 1,8,32,64)
    if [ "$1" = decode34-vllm ]; then
        # a cold start took 250 s with the Triton prefill (55 s torch.compile, 108 s of warm-up compiling)
        runs=("9b:/tmp/p9b:500::main" "27b_fp8:/tmp/s27:550::main")
        engine=vllm; VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}")
    elif [ "$1" = decode34-split ]; then
        runs=("9b_bf16state_walk:/tmp/p9b:150:HYSERVE_GDN_DECODE_SPLIT=0:decode_bf16state"
              "9b_bf16state_split:/tmp/p9b:150:HYSERVE_GDN_DECODE_SPLIT=1:decode_bf16state"
              "27b_fp8_bf16state_walk:/tmp/s27:200:HYSERVE_GDN_DECODE_SPLIT=0:decode_bf16state"
              "27b_fp8_bf16state_split:/tmp/s27:200:HYSERVE_GDN_DECODE_SPLIT=1:decode_bf16state")
        engine=hyserve
    elif [ "$1" = decode34-upfront ]; then
        runs=("9b_bf16state_asis:/tmp/p9b:150:HYSERVE_GDN_DECODE_UPFRONT=0:decode_bf16state"
              "9b_bf16state_upfront:/tmp/p9b:150:HYSERVE_GDN_DECODE_UPFRONT=1:decode_bf16state"
              "27b_fp8_bf16state_asis:/tmp/s27:200:HYSERVE_GDN_DECODE_UPFRONT=0:decode_bf16state"
              "27b_fp8_bf16state_upfront:/tmp/s27:200:HYSERVE_GDN_DECODE_UPFRONT=1:decode_bf16state")
        engine=hyserve
    elif [ "$1" = decode34-persist ]; then
        runs=("9b_bf16state_launches:/tmp/p9b:150:HYSERVE_GDN_DECODE_PERSIST=0:decode_bf16state"
              "9b_bf16state_rule:/tmp/p9b:150::decode_bf16state"
              "27b_fp8_bf16state_launches:/tmp/s27:200:HYSERVE_GDN_DECODE_PERSIST=0:decode_bf16state"
              "27b_fp8_bf16state_rule:/tmp/s27:200::decode_bf16state")
        engine=hyserve
    elif [ "$1" = decode34-layout ]; then
        runs=("9b_bf16state_key:/tmp/p9b:150:HYSERVE_GDN_STATE_LAYOUT=key:decode_bf16state"
              "9b_bf16state_value:/tmp/p9b:150:HYSERVE_GDN_STATE_LAYOUT=value:decode_bf16state"
              "27b_fp8_bf16state_key:/tmp/s27:200:HYSERVE_GDN_STATE_LAYOUT=key:decode_bf16state"
              "27b_fp8_bf16state_value:/tmp/s27:200:HYSERVE_GDN_STATE_LAYOUT=value:decode_bf16state")
        engine=hyserve
    else
        runs=("9b:/tmp/p9b:200::main" "9b_bf16state:/tmp/p9b:150::decode_bf16state"
              "27b_fp8:/tmp/s27:300::main" "27b_fp8_bf16state:/tmp/s27:200::decode_bf16state"
              "27b_fp8_unfused:/tmp/s27:200:HYSERVE_FP8_FUSED_QUANT=0:decode")
        engine=hyserve
    fi
    for spec in "${runs[@]}"; do
        IFS=: read -r run dir cap envs kind <<< "$spec"
        limit=$(moe_todo "$engine" "$run" "$cap")
        [ -n "$limit" ] || continue
        args=("${D34_MAIN[@]}"); [ "$kind" = decode ] && args=("${D34_DECODE[@]}")
        # the GDN state stored in the model's dtype, as vLLM's default keeps it (hyserve's default: float32)
        [ "$kind" = decode_bf16state ] && args=("${D34_DECODE[@]}" --mamba-ssm-cache-dtype auto)
        [ "$dir" = /tmp/s27 ] && args+=(--load-format dummy)
        # FlashInfer's GDN prefill JIT took over 7 minutes on a fresh H100 (2026-12-05, the call timed out in it):
        # unless its module is here, vLLM's prefill runs on its Triton kernel, as the JSON records
        [ "$engine" = vllm ] && ! vllm_warm && args+=(--vllm-gdn-prefill-backend triton)
        # shellcheck disable=SC2086
        ( [ -n "$envs" ] && export $envs; measure "$engine" "$dir" "$run" "$limit" "${args[@]}" )
        moe_done "$engine" "$run" "$OUT/${engine}_$run.json" decode_bs1_tok_s
    done
    true
    ;;
  profile34)
    # Issue 34, item 3: where a decode step's device time goes in each engine, by its own profiler (peer_bench.py's
    # profile measure: two profiled runs, 9 tokens and 24 more, their difference per step by kernel and family),
    # the 9B bf16 with bf16 GDN states (vLLM's like) at batch 1 and 64: which of hyserve's families is longer than
    # vLLM's. hyserve's first (150 s), then vLLM's default mode (a cold start, about 250 s, then the runs). Each run
    # marked done in $MOE_DONE (a later call goes on where this one stopped); profile34 vllm: vLLM's alone.
    p9b
    for spec in "hyserve:200" "vllm:480"; do
        IFS=: read -r engine cap <<< "$spec"
        limit=$(moe_todo "$engine" 9b_profile "$cap")  # profile34 ENGINE: that engine's run alone ($MOE_ONLY)
        [ -n "$limit" ] || continue
        args=(--measures profile --profile-batches 1,64 --profile-steps 24 --mamba-ssm-cache-dtype auto)
        [ "$engine" = vllm ] && ! vllm_warm && args+=(--vllm-gdn-prefill-backend triton)
        ( [ "$engine" = vllm ] && VLLM_ENV=("${VLLM_DEFAULT_ENV[@]}"); measure "$engine" /tmp/p9b 9b_profile "$limit" "${args[@]}" )
        moe_done "$engine" 9b_profile "$OUT/${engine}_9b_profile.json" families_ms_per_step
        python3 - "$OUT/${engine}_9b_profile.json" <<'PY' || true
import json, sys
res = json.load(open(sys.argv[1]))
for p in res.get("profiles", []):
    print(p["label"], f"{p['kernel_ms_per_step']:.3f} ms/step", {k: round(v, 3) for k, v in p["families_ms_per_step"].items()})
print("errors", res.get("errors"))
PY
    done
    ;;
  prefill34)
    # Issue 34, item 2: where a 32 x 2048 prefill's time goes at HEAD on the 2B and 9B shapes (kernels by family,
    # the device's idle gaps put down to the host, a sync or the device: profile_prefill.py with trace_gaps.py), and
    # the conv's prefill launch against the card's copy rate and against its form before 2026-12-05.
    p2b; p9b
    timeout 120 python3 benchmarks/conv_prefill_bench.py --out "$OUT" > "$OUT/conv_prefill.log" 2>&1
    echo "conv_prefill_bench rc $?"; tail -5 "$OUT/conv_prefill.log"
    for m in 2b 9b; do
        timeout "$(left 60)" python3 benchmarks/profile_prefill.py --model /tmp/p$m --out "$OUT/prefill_$m" \
            > "$OUT/profile_prefill_$m.log" 2>&1
        echo "profile_prefill $m rc $?"; grep -A14 '"prefill_tok_s"\|device window' "$OUT/profile_prefill_$m.log" | head -40
    done
    ;;
  short-rows)
    # Issue 34: verify rows (k + 1 tokens) through the split-context attention kernel: its CUDA tests and the
    # speculative paths' (device drafts, rows behind), then one layer's attention at the 27B's and the 9B's heads,
    # 3 tokens a row, against the same rows through the prefill kernel and the card's copy rate.
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_short_rows.py tests/kernels/test_attention_sdpa.py \
        tests/kernels/test_kernels.py tests/worker/test_async_verify.py tests/worker/test_device_drafts.py \
        tests/model/test_prefill_attention.py -k "cuda or gpu" > "$OUT/short_rows_tests.log" 2>&1
    echo "short-row tests rc $?"; tail -2 "$OUT/short_rows_tests.log"
    timeout "$(left 10)" python3 benchmarks/attention_decode_bench.py --shapes 27b 9b --batch 1 8 32 64 \
        --context 2048 6144 --query-len 3 --model-len 62768 --out "$OUT" > "$OUT/attention_verify.log" 2>&1
    echo "attention bench rc $?"; tail -18 "$OUT/attention_verify.log"
    ;;
  verify-fused)
    # Issue 34: the fused GDN verify launch (the seed's decode steps: 117 us a layer at about 18 rows of 3 tokens,
    # where the rows' state reads take about 23 us) against the fused decode, at the 27B's and 9B's heads, k = 2,
    # value-major float32 state; then the fused verify's CUDA tests (the walk and the split launch).
    # Each point also times the verify's split launch (one program a (row, value head, value block)) at four
    # (value block, warps): split_best_us, split_speedup (2026-12-07c: the walk 106 us at 16 rows of the 27B's heads
    # against 55 us for the decode, which reads and writes the states).
    timeout 330 python3 benchmarks/gdn_verify_bench.py --fused --shapes 27b 9b --batch 1 8 16 32 64 --k 1 2 \
        --layout v --out "$OUT" > "$OUT/gdn_verify_fused.log" 2>&1
    echo "verify bench rc $?"; tail -22 "$OUT/gdn_verify_fused.log"
    timeout "$(left 10)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_verify_fused.py \
        -k "cuda" > "$OUT/verify_fused_tests.log" 2>&1
    echo "tests rc $?"; tail -2 "$OUT/verify_fused_tests.log"
    ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
