#!/bin/bash
# hyserve soak against the seed-flag server (serve.sh); replay on a one-process plain synchronous float32 engine,
# reference = transformers 5.24 (teacher-forced), aborts on.
export OMP_NUM_THREADS=1
exec /work/main/.venv/bin/hyserve soak /tmp/q4soak/ckpt --url http://127.0.0.1:18741 \
    --conversations 48 --turns 4 --concurrency 8 --prefix-len 100 --message-len 24 --max-tokens 24 \
    --abort-fraction 0.2 --workload-seed 0 --reference --replay \
    --device cpu --dtype float32 --no-async-scheduling --report soak_report.json
