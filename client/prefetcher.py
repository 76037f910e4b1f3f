"""Prefetcher: the background worker behind ExpertPool.prefetch (docs/architecture.md, "Next-layer prefetch").

One thread per pool, started by the first prefetch. A job loads a layer's guessed experts that L0 lacks (and,
where the pool computes on L2's records in place, that L2 lacks too: those cost nothing already) into the side
rows of the layer (client/layerpool.py: rows past the demand ceiling, for guesses only, that no queued work
reads), through the pool's own load path (L2 copy, else the model file, checked as configured), and holds them
there as guesses once every byte is in place. It evicts nothing and tells the daemon nothing: a wrong guess
costs bandwidth, never a demand hit in L0 or L2. The pool's fetch of that layer first calls `before_fetch`, which
settles it: a job not started yet is cancelled, a running one waited for (stall); then its `take_rows` promotes the
guesses it demands (a swap of rows, no copy) and drops the rest. A pool without side rows (prefetch off) never
calls it, and its `prefetch` only counts the request. No MLX computation runs on the worker; the copies and reads
release the GIL. Counts what it did in PrefetchCounts.

How many side rows: SIDE_GENERATIONS x top_k (`side_rows`), per layer, or in all with a shared L0, where one
layer at a time has guesses (the next one): top_k guesses (what the router picks per token) and room for the
top_k rows that the last promotion took out of demand, which queued work may still read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from moe_l2.cache.score import prefetch_rates
from moe_l2.protocol import PREFETCH_COUNTERS

log = logging.getLogger("moe-l2.client")

# Side rows per top_k: the guesses being written, and the rows the last promotion took out of demand.
SIDE_GENERATIONS = 2


def side_rows(top_k: int) -> int:
    """The side rows next-layer prefetch needs: per layer, or in all with a shared L0."""
    return SIDE_GENERATIONS * top_k

# PrefetchCounts' byte counts as JSON names them, by their unit (the fields keep the names the bench reads).
_JSON_NAMES = {"bytes_copied": "copied_bytes", "bytes_read": "read_bytes"}


@dataclass
class PrefetchCounts:
    """What next-layer prefetch did: experts loaded ahead into side rows (`issued`), of which promoted by the
    layer's fetch (`useful`) or dropped undemanded (`wasted`); the rest are still held. Guesses are scored against the
    next fetch of their layer (`guessed`, `picked`, `right`: precision and recall of the predictor)."""

    requests: int = 0    # prefetch() calls
    cancelled: int = 0   # of them dropped unstarted because their layer's fetch came first
    guessed: int = 0
    picked: int = 0
    right: int = 0
    issued: int = 0
    useful: int = 0
    wasted: int = 0
    bytes_copied: int = 0  # from L2
    bytes_read: int = 0    # from the model files
    worker_s: float = 0.0  # the worker's time loading
    wait_s: float = 0.0    # fetches waiting for a prefetch of their layer to finish (stall)
    errors: int = 0        # prefetches that failed (the demand fetch reads those experts again)

    def add(self, other: "PrefetchCounts") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def minus(self, other: "PrefetchCounts") -> "PrefetchCounts":
        return PrefetchCounts(**{n: getattr(self, n) - getattr(other, n) for n in self.__dataclass_fields__})

    def to_json(self) -> dict:
        """The counts with their rates, byte counts named by their unit (`generate --json`'s "prefetch")."""
        out = {_JSON_NAMES.get(name, name): getattr(self, name) for name in self.__dataclass_fields__}
        out.update(prefetch_rates(self.wire()))
        return out

    def wire(self) -> dict[str, int]:
        """The totals as a report carries them (protocol.PREFETCH_COUNTERS)."""
        return {name: round(getattr(self, name.removesuffix("_us") + "_s") * 1e6) if name.endswith("_us")
                else getattr(self, name) for name in PREFETCH_COUNTERS}


@dataclass
class _Job:
    layer: int
    guesses: list[int]
    state: str = "queued"  # queued -> running -> done, or queued -> cancelled
    done: threading.Event = field(default_factory=threading.Event)


class Prefetcher:
    """The prefetch jobs of one ExpertPool and the thread that runs them."""

    def __init__(self, pool):
        self.pool = pool
        self._counts = PrefetchCounts()
        self._counts_lock = threading.Lock()
        self._jobs: dict[int, list[_Job]] = {}
        self._jobs_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._guesses: dict[int, list[int]] = {}

    def counts(self) -> PrefetchCounts:
        """What prefetch did so far (a copy; useful and wasted of L0 prefetches are the layers' own counts)."""
        with self._counts_lock:
            out = replace(self._counts)
        out.useful += sum(lp.prefetch_useful for lp in self.pool.layers.values())
        out.wasted += sum(lp.prefetch_wasted for lp in self.pool.layers.values())
        return out

    def prefetch(self, layer: int, guesses) -> None:
        """Queue a job for the guessed experts of `layer`; returns at once. At most as many guesses are
        loaded as the side rows allow."""
        n_experts = self.pool.files.n_experts
        guesses = [int(e) for e in dict.fromkeys(guesses)]
        for expert in guesses:
            if not 0 <= expert < n_experts:
                raise IndexError(f"expert {expert} out of range 0..{n_experts - 1}")
        with self._counts_lock:
            self._counts.requests += 1
        if not self.pool.side_rows:  # nowhere to load a guess
            return
        with self._jobs_lock:
            self._guesses[layer] = guesses
        if self.pool.lend:  # what L2 holds is computed on in place, at no cost
            guesses = self.pool.not_in_l2(layer, guesses)
        if not guesses:
            return
        job = _Job(layer, guesses)
        with self._jobs_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="moe-l2-prefetch", daemon=True)
                self._worker.start()
            self._jobs.setdefault(layer, []).append(job)
        self._queue.put(job)

    def before_fetch(self, layer: int, batch: set[int]) -> frozenset[int]:
        """Settle the layer, then score its latest guesses against the batch the forward demands; returns the
        guesses its side rows hold (a fetch promotes those it demands: `take_rows`)."""
        self.settle(layer)
        with self._jobs_lock:
            guesses = self._guesses.pop(layer, None)
        if guesses is not None:
            with self._counts_lock:
                self._counts.guessed += len(guesses)
                self._counts.picked += len(batch)
                self._counts.right += len(batch.intersection(guesses))
        return self.pool.layers[layer].prefetched()

    def take_rows(self, layer: int, lp, batch: set[int], missing: list[int], take) -> tuple[int, dict[int, int]]:
        """The pool's `take` of rows for a fetch's misses, with the guesses the layer holds promoted instead of
        filled (a swap of rows, no copy) and the rest of them dropped: (how many were promoted, expert -> row of
        the misses left to fill)."""
        held = lp.prefetched()
        guessed = [e for e in missing if e in held]
        taken = {}
        if missing:
            if self.pool.shared_l0 and lp.rows.would_grow(len(missing)):
                self.settle_all()  # growing copies every row: no guess may be landing in the old ones
            taken = take(layer, lp, batch, missing)
            lp.promote(guessed, [taken.pop(e) for e in guessed])
        lp.drop_guesses()
        return len(guessed), taken

    def settle(self, layer: int) -> None:
        """Cancel the layer's jobs that have not started and wait for the one running, if any (the time
        waited counts as `wait_s`: stall)."""
        with self._jobs_lock:
            jobs = self._jobs.pop(layer, [])
            cancelled = 0
            for job in jobs:
                if job.state == "queued":
                    job.state = "cancelled"
                    cancelled += 1
        if not jobs:
            return
        start = time.perf_counter()
        for job in jobs:
            if job.state != "cancelled":
                job.done.wait()
        with self._counts_lock:
            self._counts.cancelled += cancelled
            self._counts.wait_s += time.perf_counter() - start

    def settle_all(self) -> None:
        """settle every layer (before shared rows grow: the worker may be writing any layer's side rows)."""
        for layer in self.pool.layers:
            self.settle(layer)

    def wait(self, layer: int | None = None) -> None:
        """Wait until the jobs queued so far for the layer (None: every layer) are done, cancelling none."""
        with self._jobs_lock:
            jobs = [j for lay, js in self._jobs.items() if layer is None or lay == layer for j in js]
        for job in jobs:
            job.done.wait()

    def _work(self) -> None:
        """One job at a time, until close() sends None."""
        while (job := self._queue.get()) is not None:
            with self._jobs_lock:
                if job.state == "cancelled":
                    job.done.set()
                    continue
                job.state = "running"
            try:
                self._run(job)
            except Exception as exc:  # a wrong guess costs bandwidth, never the forward: fetch reads it again
                log.warning("prefetch of MoE layer %d failed (%s); those experts are fetched on demand",
                            job.layer, exc)
                with self._counts_lock:
                    self._counts.errors += 1
            finally:
                job.state = "done"
                job.done.set()

    def _run(self, job: _Job) -> None:
        pool = self.pool
        lp = pool.layers[job.layer]
        start = time.perf_counter()
        experts, rows = lp.take_side_rows(job.guesses)
        if not experts:
            return
        _, counts = pool.loader.load_rows(job.layer, lp, experts, rows, side=True)
        lp.hold_guesses(experts, rows)
        with self._counts_lock:
            self._counts.issued += len(experts)
            self._counts.bytes_copied += counts.bytes_copied
            self._counts.bytes_read += counts.bytes_read
            self._counts.worker_s += time.perf_counter() - start

    def close(self) -> None:
        """Cancel what has not started, wait for the rest, stop the thread."""
        if self._worker is None:
            return
        self.settle_all()
        self._queue.put(None)
        self._worker.join()
        self._worker = None
