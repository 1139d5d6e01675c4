#!/bin/bash
# The seed's `vllm serve` line with `hyserve` in vllm's place (report 1's flags; partition scaled to 9 layers), on the CPU.
export VLLM_PP_LAYER_PARTITION=3,3,2,1 OMP_NUM_THREADS=1 HYSERVE_EMULATE_CUDA_GRAPHS=1
exec /work/main/.venv/bin/hyserve serve /tmp/q4soak/ckpt --device cpu --dtype float32 --port 18741 \
    --pipeline-parallel-size 4 --max-num-seqs 8 --enable-prefix-caching --mamba-cache-mode align \
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 4}' \
    --compilation-config '{"cudagraph_mode": "FULL_AND_PIECEWISE"}' --async-scheduling
