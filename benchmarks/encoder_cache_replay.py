"""How often the seed's screenshots would be encoded with an LRU encoder cache of N screenshots.

A closed loop of 32 agents (each agent's next request after its last, at jittered intervals), episodes of 3-10
steps as ``seed_bench.py`` draws them. A request at step s needs the tower for its new screenshot and, from the fourth
step on (the oldest screenshot turned into text, the prefix cache resuming before the two kept), for its two before.
Counts the encodes per request through an LRU of each size (one is the least possible)::

    python benchmarks/encoder_cache_replay.py --sizes 37,74,96,128,256
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict


def encodes(capacity: int, agents: int = 32, requests: int = 256, seed: int = 0) -> int:
    rng = random.Random(seed)
    episodes = 0

    def new_episode() -> dict[str, int]:
        nonlocal episodes
        episodes += 1
        return {"episode": episodes, "step": 0, "steps": rng.randint(3, 10)}

    state = [new_episode() for _ in range(agents)]
    due = [rng.random() for _ in range(agents)]
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    count = 0
    for _ in range(requests):
        a = min(range(agents), key=due.__getitem__)
        st = state[a]
        s = st["step"]
        for shot in [(st["episode"], j) for j in (range(s - 2, s + 1) if s >= 3 else (s,))]:
            if shot in cache:
                cache.move_to_end(shot)
                continue
            count += 1
            cache[shot] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
        due[a] += 1 + 0.6 * rng.random()
        st["step"] += 1
        if st["step"] >= st["steps"]:
            state[a] = new_episode()
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="37,74,96,128,256")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    for size in (int(x) for x in args.sizes.split(",")):
        per = [encodes(size, requests=args.requests, seed=s) / args.requests for s in range(args.seeds)]
        print(f"LRU of {size:4d} screenshots: {sum(per) / len(per):.2f} encodes per request "
              f"({min(per):.2f}-{max(per):.2f} over {args.seeds} seeds)")


if __name__ == "__main__":
    main()
