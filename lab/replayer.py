"""One client process of `moe-l2 bench`: a routing trace's tokens through a real ExpertPool, with no model compute.

Per token and MoE layer it fetches the layer's picks exactly as a streamed forward does (`ExpertPool.borrow`
where L2 lends its records in place, else `ExpertPool.fetch`),
then waits the configured compute time, during which background work may run. Stall is the time `fetch` took:
what compute did not hide (docs/architecture.md, "The bench").

Run as ``python -P -m moe_l2.lab.replayer`` (the bench runs it tied to itself: lab/lifeline.py); it
speaks JSON lines. The first line on stdin is the job::

    {"model": DIR, "capacity": L0 experts per layer, "direct": true|false|null, "socket": ADDRESS or null,
     "policy": L0 policy, "cgroup": DIR or null, "compute_ms": per layer, "warmup": tokens,
     "prefetch": true|false (next-layer prefetch, the logistic predictor),
     "load_through_ms": how long a miss waits for the daemon to load it into L2 (0: read the file at once),
     "lend": true|false (compute on L2's records in place, or copy them into L0),
     "shared_l0": true|false (capacity is L0 rows in all, which every layer takes from),
     "tokens": [[[experts of layer 0], ...], ...]}

It answers ``{"ready": ...}`` once the pool exists, waits for a line, replays the warm-up tokens, answers
``{"warm": true}``, waits for a line, replays the rest and answers with its counts; each further line replays
the rest again (a warm pass) and answers with its counts, until stdin ends. It answers once the daemon's fill desk
took every record it gave (`_wait_given`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from moe_l2.client.connection import L2Client
from moe_l2.lm.streamed_lm import peak_rss_bytes
from moe_l2.lm.nextlayer import NextLayer
from moe_l2.client.pool import ExpertPool
from moe_l2.model import ModelFiles


def anon_bytes(pid: int | str = "self") -> int:
    """A process' anonymous memory (Linux: RssAnon, which shared memory and the page cache are not part of);
    elsewhere this process' peak resident size, and 0 for another process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes() if pid == "self" else 0


def disk_read_bytes(pid: int | str = "self") -> int | None:
    """Bytes this process (all its threads) made the kernel fetch from storage: page-cache hits are not in it.
    None where /proc is not there (macOS)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _wait_for_go() -> None:
    if not sys.stdin.readline():
        sys.exit(0)  # the bench went away


def replay(pool: ExpertPool, tokens: list, compute_s: float,
           next_layer: NextLayer | None = None) -> tuple[float, int, float]:
    """Fetch each token's experts layer by layer, computing (waiting) compute_s after each; returns the stall.
    A pool that lends computes on L2's records in place, as the streamed forward does: the misses L2 holds are
    lent instead of copied, and a loan the daemon tore during the compute costs a fetch and the compute again.
    With next_layer, each layer's picks also start the prefetch of the next layer's guesses, as the streamed
    forward does (it has no hidden state here, so only a router-free predictor can guess: logistic).
    Returns the stall, the lookups of layers computed again (torn loans), which the pool counted twice, and the
    time to the first token (its stall and compute)."""
    stall = 0.0
    torn = 0
    first = None
    clock = time.perf_counter

    def compute(since: float) -> None:
        # A sleep, so that background threads (the client's, a prefetch) may run.
        deadline = since + compute_s
        while (left := deadline - clock()) > 0:
            time.sleep(left)

    for token in tokens:
        for layer, experts in enumerate(token):
            start = clock()
            loan = pool.borrow(layer, experts)[1] if pool.lend else None
            if loan is None:
                pool.fetch(layer, experts)
            if next_layer is not None:
                next_layer.after(layer, None, np.asarray([experts]))
            done = clock()
            stall += done - start
            compute(done)
            if loan and loan.torn():
                torn += len(set(experts))
                start = clock()
                pool.fetch(layer, experts)
                stall += clock() - start + compute_s
                compute(clock())
        if first is None:
            first = stall + compute_s * len(token)
    return stall, torn, first or 0.0


def _wait_given(pool: ExpertPool) -> None:
    """Until the desk answered every record this process gave it; the bench then waits for the daemon's copies and
    loads (connection.wait_idle), so that the next pass, or process, starts from what this one left in L2."""
    if pool.donor is not None and not pool.donor.wait_answered(10):
        raise RuntimeError("moe-l2d's fill desk left gives of this process unanswered for 10 s (its log says why)")


def main() -> int:
    job = json.loads(sys.stdin.readline())
    if job.get("cgroup"):
        # Join before touching the model: the page cache our reads bring in is charged to this group.
        with open(os.path.join(job["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    files = ModelFiles.open(job["model"])
    load_through_s = job.get("load_through_ms", 0) / 1e3
    client = L2Client(files, job["socket"], wait_s=10) if job.get("socket") else None
    if client is not None and not client.attached:
        _say({"error": f"no moe-l2d answered at {job['socket']}: {client.last_error}"})
        return 1
    # Records read from the file are checked against the manifest (the default verify), as a user's process checks
    # them: every configuration alike.
    pool = ExpertPool(files, job["capacity"], client, policy=job["policy"], direct=job["direct"],
                      load_through_s=load_through_s, lend=job.get("lend", True), shared_l0=job.get("shared_l0", False),
                      grow=job.get("grow", False), prefetch=bool(job.get("prefetch")),
                      autopin=job.get("autopin", False), fill_l2=job.get("fill_l2", False))
    if pool.donor is not None:
        pool.donor.wait_accepted(10)  # measured from the first lookup on, as a served process that has run a while
    next_layer = NextLayer("logistic", pool) if job.get("prefetch") else None
    tokens, warmup, compute_s = job["tokens"], job["warmup"], job["compute_ms"] / 1e3
    _say({"ready": True, "anon_bytes": anon_bytes()})
    _wait_for_go()
    replay(pool, tokens[:warmup], compute_s, next_layer)
    pool.wait_prefetches()
    _wait_given(pool)
    _say({"warm": True})
    _wait_for_go()
    while True:
        before, ahead, waits, disk_before = pool.counts, pool.prefetch_counts, pool.waits, disk_read_bytes()
        stall, torn, first = replay(pool, tokens[warmup:], compute_s, next_layer)
        pool.wait_prefetches()
        after, disk_after = pool.counts, disk_read_bytes()
        _wait_given(pool)
        counts = dataclasses.asdict(after.minus(before))
        prefetch = dataclasses.asdict(pool.prefetch_counts.minus(ahead))
        _say({"tokens": len(tokens) - warmup, "stall_s": stall, "first_token_s": first, "torn_lookups": torn,
              "counts": counts, "prefetch": prefetch, "waits": dataclasses.asdict(pool.waits.minus(waits)),
              "disk_read_bytes": None if disk_before is None else disk_after - disk_before,
              "anon_bytes": anon_bytes()})
        if not sys.stdin.readline():
            break
    pool.close()
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
