"""The engine's loop thread handing a step with a screenshot to a worker process, timed on the host alone.

With ``--distributed-executor-backend mp`` every step crosses a pipe to the worker pickled. A 1280 x 720 screenshot's
pixels are 3,520 x 1,536 float32 (21.6 MB). This times, on the loop thread, the send alone (what the loop thread
spends before it goes on: through the pipe it waits for the worker to read the bytes) and the send with the
worker's one-line answer read back (the worker reads the step, copies the pixels out, answers), through the pipe
as before (``Connection.send``) and through the executor's step pickler (``_StepPickler``: arrays of a megabyte or
more in shared memory segments), with fresh segments each step (unlinked once answered) and with the executor's
pool (segments reused once answered). The worker is started as the executor starts its
workers (``subprocess``, its end of the pipe passed by descriptor).

Run: ``python benchmarks/step_handoff_bench.py [--images 2] [--repeat 10]`` (prints the median and the spread)."""

from __future__ import annotations

import argparse
import io
import multiprocessing
import multiprocessing.connection
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyserve.executor import multiproc


def worker(fd: int) -> None:
    conn = multiprocessing.connection.Connection(fd)
    while True:
        msg = conn.recv()  # copies shared arrays out as it unpickles (multiproc._copy_out)
        if msg is None:
            return
        conn.send(sum(float(a[0, 0]) for a in msg["pixels"]))


def check(got: float, want: float, how: str) -> None:
    if got != want:
        raise SystemExit(f"the worker read other pixels through {how}: {got} != {want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # the worker process: its end of the pipe
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    here, there = multiprocessing.Pipe(duplex=True)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(there.fileno())],
                            pass_fds=(there.fileno(),))
    there.close()
    rng = np.random.default_rng(0)
    step = {"pixels": [rng.random((3520, 1536), dtype=np.float32) for _ in range(args.images)],
            "token_ids": list(range(6000))}
    want = sum(float(a[0, 0]) for a in step["pixels"])
    ways = {"shared memory, fresh": multiproc.SegmentPool(max_bytes=0),
            "shared memory, pooled": multiproc.SegmentPool()}
    times: dict[str, list[float]] = {f"{k}: {w}": [] for k in ("pipe", *ways) for w in ("send", "answered")}
    for _ in range(args.repeat + 1):  # the first round warms every way up
        t0 = time.perf_counter()
        here.send(step)
        t1 = time.perf_counter()
        check(here.recv(), want, "pipe")
        times["pipe: send"].append(t1 - t0)
        times["pipe: answered"].append(time.perf_counter() - t0)
        for how, pool in ways.items():
            t0 = time.perf_counter()
            segments = multiproc._Segments(pool, waiting=1)
            buf = io.BytesIO()
            multiproc._StepPickler(buf, segments).dump(step)
            here.send_bytes(buf.getbuffer())
            t1 = time.perf_counter()
            check(here.recv(), want, how)
            segments.answered()
            times[f"{how}: send"].append(t1 - t0)
            times[f"{how}: answered"].append(time.perf_counter() - t0)
    for pool in ways.values():
        pool.close()
    here.send(None)
    proc.wait()
    print(f"a step with {args.images} screenshot(s) handed to a worker process, loop thread, ms "
          f"({os.cpu_count()} CPUs)")
    for how, ts in times.items():
        ts = sorted(ts[1:])
        print(f"  {how:32s} median {1e3 * statistics.median(ts):7.1f}   min {1e3 * ts[0]:7.1f}"
              f"   max {1e3 * ts[-1]:7.1f}")


if __name__ == "__main__":
    main()
