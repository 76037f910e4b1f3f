"""L3 (model file) reads, measured side by side in one run (ratios: machines and disks are noisy).

1. Raw sequential read speed of the model files (8 MiB reads, one stream, like dd), cold, buffered and direct.
2. Miss cost per expert through the client's real read path (ExpertPool.fetch with no daemon): stacked
   safetensors (one read per piece) vs packed (one read per expert), buffered vs direct I/O, cold (the files
   dropped from the page cache with posix_fadvise(DONTNEED) before every fetch) and warm (files in the page
   cache), one expert per fetch and a batch of --batch experts per fetch; each as time per expert, the bandwidth
   it amounts to, and that bandwidth over the sequential read speed of (1).
3. The page cache of an unrelated file before and after streaming every expert of a model larger than the
   memory it may use, buffered vs direct. Run as root on Linux, the streaming process joins a memory cgroup
   limited to --cgroup-mb (page cache counts against it), so that "larger than memory" holds on any machine;
   elsewhere it reports how much of the model the stream left in the page cache.
4. Queue depth of a packed model's cold direct misses: the client's reads (ExpertPool.fetch) on 1, 2, 4 and 8
   threads with each record read in units of 8 MiB down to 256 KiB (so a record's read is split over the
   threads), against the daemon's loaders (4 threads, one read per record) and a raw sequential direct read of
   the same number of bytes (8 MiB reads, one stream, at a random place in the file); interleaved round by
   round (the disk drifts), medians, each as MiB/s and over the raw read of its round; the client's rows: the read
   alone ("read"), with its default check against the manifest, CRCs computed by the read threads ("checked",
   the CPU's CRC where it has one), the same read through the scratch and copied into the rows ("copied", as
   before pieces were read straight into them, and as pieces of sizes that are not whole blocks were before they
   were read as one range; same pool, so same rows, as "checked"), with the CPU's CRC folding 128 bits at a time
   where it can fold 512 ("crc 128b"), with zlib's CRC ("zlib crc"), zlib's CRC of each record computed after
   every record was read ("crc after"), and the read alone without the pool around it ("no pool": the native
   read into free rows of the same pool, so what fetch itself costs shows); and the raw read with each of its
   reads checksummed after it lands ("raw checked"): the floor of a check that cannot overlap a read, as for a
   lone miss on a disk that completes a record's parts together. And a real moe-l2d serving the model
   ("load-through": a pool with a daemon fetches misses L2 lacks, which the daemon reads and announces and the
   pool copies: what a process with a daemon waits for on a cold miss, its report and wake-up included), and the
   same daemon taking fills ("filled": a pool of the daemon's uid reads the misses itself, as "checked", and gives
   them to L2 off the token's path, client/donor.py; its line also says its speed over the pool's own checked
   read of the same round, the median of the rounds' ratios, and how long after the fetch L2 held them: the
   offer's round trip, the copy into the slots and the daemon's check). Every config but the pool's modes reads
   as the shipped code does (`read_as`).
   Misses land in every row of a pool in turn, as a full pool's victims do.
5. The same packed misses warm and buffered (the file in the page cache, --direct-io off): read straight into
   the rows against through the scratch and copied, one pool, interleaved: the copy's cost without a disk.
6. Where a direct read lands: one record read cold into each of several buffers and two segments made as
   moe-l2d makes L2's (where a miss read straight into a slot would land), round by round, as moe-l2d's loaders
   read it and as a client does, with how many physically contiguous runs each one's pages form
   (/proc/self/pagemap: Linux, as root). On a VM whose disk emulation handles each run apart, this and not the
   read path sets a direct read's speed; buffers on huge pages (what _native.Buffer asks Linux for) form one or
   two runs.

    python bench/bench_io.py [--model DIR] [--experts 64] [--layers 4] [--hidden 2048] [--moe-hidden 768]
                             [--samples 40] [--batch 8] [--cgroup-mb 256] [--rounds 15] [--keep DIR]
                             [--queue-depth-only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moe_l2 import _native
from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.client.row_loader import READ_THREADS
from moe_l2.lab.daemon_process import DaemonProcess
from moe_l2.layout import Geometry
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles
from moe_l2.model.packed import READ_UNIT_BYTES
from moe_l2.model.packer import pack
from moe_l2.sizes import format_size

MIB = 1 << 20


def drop(paths) -> None:
    if not hasattr(os, "posix_fadvise"):
        raise SystemExit("bench_io measures cold reads and drops the page cache with posix_fadvise, which this "
                         "system lacks (macOS); run it on Linux")
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _native.page_cache_bytes(fd)
    finally:
        os.close(fd)


def warm(paths) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(8 * MIB):
                pass


def sequential(paths, direct: bool, streams: int = 1) -> float:
    """Bytes per second of reading the files front to back from a cold cache: 8 MiB reads, `streams` at a time."""
    drop(paths)
    block = 8 * MIB * streams
    buf = _native.Buffer(block)
    total = 0
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if direct:
                _native.set_direct(fd, True)
            size = os.fstat(fd).st_size
            for off in range(0, size, block):
                n = min(block, size - off)
                _native.pread_records([(fd, off, n, buf, 0)], threads=streams)  # 8 MiB units over the threads
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - start)


def miss_cost(files: ModelFiles, direct: bool, cold: bool, batch: int, samples: int, seed: int) -> float:
    """Median seconds per expert of ExpertPool.fetch of `batch` missing experts."""
    rng = random.Random(seed)
    pool = ExpertPool(files, capacity=files.n_experts, direct=direct)
    if not cold:
        warm(files.files)
    per_expert = []
    try:
        for _ in range(samples):
            layer = rng.randrange(files.n_layers)
            experts = rng.sample(range(files.n_experts), batch)
            if cold:
                drop(files.files)
            start = time.perf_counter()
            pool.fetch(layer, experts)
            per_expert.append((time.perf_counter() - start) / batch)
            for e in experts:
                pool.evict(layer, e)
    finally:
        pool.close()
    return statistics.median(per_expert)


STREAM = r"""
import json, os, sys
from moe_l2 import _native
from moe_l2.client.pool import ExpertPool
from moe_l2.model import ModelFiles

model, unrelated, direct, cgroup = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
files = ModelFiles.open(model)
pool = ExpertPool(files, capacity=files.top_k, direct=direct)
paths = [unrelated, *files.files]

def cached(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return _native.page_cache_bytes(fd)
    finally:
        os.close(fd)

for path in paths:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
if cgroup:  # from here on, page cache this process brings in counts against the cgroup's limit
    with open(cgroup, "w") as f:
        f.write(str(os.getpid()))
with open(unrelated, "rb") as f:
    while f.read(8 << 20):
        pass
before = cached(unrelated)
for layer in range(files.n_layers):
    for start in range(0, files.n_experts, files.top_k):
        pool.fetch(layer, list(range(start, min(files.n_experts, start + files.top_k))))
after = cached(unrelated)
print(json.dumps({"before": before, "after": after, "model_cached": sum(cached(p) for p in files.files),
                  "unrelated": os.path.getsize(unrelated),
                  "model": sum(os.path.getsize(p) for p in files.files)}))
"""


UNITS = (8 * MIB, 1 * MIB, 256 << 10)
THREADS = tuple(sorted({1, 2, 4, 8, READ_THREADS}))  # and the pool's own, which the filled line is set against
LOADERS = 4  # moe-l2d's default --loader-threads: each reads one record on one thread
LOAD_THROUGH_S = 2.0  # so long that every miss of "load-through" is the daemon's read, none the pool's own
# The read alone; with the default check of each record against the manifest, its CRC computed by the read
# threads as the bytes land (the CPU's CRC where it has one: native/crc32.cpp); checked and read through the
# scratch, every piece copied out of it into the rows, as before pieces were read straight into them;
# checked with the CPU's CRC folding 128 bits at a time, as before it folded 512 where the CPU can; checked with
# zlib's CRC, as before the CPU's was used; checked as before that, the CRC of each record computed after all
# were read; and the read alone without the pool around it (its native read into free rows of the same pool:
# what fetch's bookkeeping and wait for queued work cost).
MODES = {"read": "off", "checked": "file", "copied": "file", "crc 128b": "file", "zlib crc": "file",
         "crc after": "off", "no pool": "off"}


def raw_read(files: ModelFiles, nbytes: int, rng: random.Random, buf, check: bool = False) -> float:
    """Seconds to read `nbytes` of the largest model file (the experts') front to back from a random aligned
    place, direct, 8 MiB reads on one stream into `buf` (8 MiB, touched before): what the disk gives a
    sequential reader of the same file the misses read. check: each read's bytes are checksummed after it
    (the CPU's CRC, one pass over memory the disk just wrote, as a checked miss makes at least once)."""
    path = max(files.files, key=os.path.getsize)
    size = os.path.getsize(path)
    nbytes = -(-nbytes // 4096) * 4096  # direct reads are whole blocks
    start = rng.randrange(0, max(1, size - nbytes)) // 4096 * 4096
    drop([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        _native.set_direct(fd, True)
        began = time.perf_counter()
        view = buf.view()
        for off in range(start, start + nbytes, 8 * MIB):
            n = min(8 * MIB, start + nbytes - off)
            _native.pread_records([(fd, off, n, buf, 0)], threads=1)
            if check:
                _native.crc32(view[:n])
        return time.perf_counter() - began
    finally:
        os.close(fd)


def loaders_read(files: ModelFiles, fds: list[int], layer: int, experts: list[int], pool: ThreadPoolExecutor,
                 slots: list) -> float:
    """Seconds for moe-l2d's loaders to read the experts' records into slot memory (daemon/loader.py)."""
    span = files.layout.span
    began = time.perf_counter()
    list(pool.map(lambda job: files.read_into_slots(fds, layer, [(job[0], job[1], 0, span)], threads=1),
                  zip(experts, slots)))
    return time.perf_counter() - began


def rows_read(files: ModelFiles, fds: list[int], pool: ExpertPool, layer: int, experts: list[int],
              threads: int) -> float:
    """Seconds for the native read of the experts' records into the rows the pool's next fetch would take (free:
    the section evicts what it fetches), without the pool's fetch around it: the same memory as `fetch`'s."""
    lp = pool.layers[layer]
    free = lp.rows.free  # take_rows hands out the last first
    targets = [(e, lp.places(free[-1 - i])) for i, e in enumerate(experts)]
    began = time.perf_counter()
    files.read_into_rows(fds, layer, targets, threads=threads)
    return time.perf_counter() - began


def through_read(files: ModelFiles, pool: ExpertPool, layer: int, batch: int, rng: random.Random) -> float | None:
    """Seconds for a pool with a daemon to fetch `batch` experts L2 lacks, each loaded through (reported, read by
    moe-l2d into L2, announced, copied into L0); None if any came another way."""
    index = pool.client.attachment.slot_indexes[layer]
    experts = rng.sample([e for e in range(files.n_experts) if index.slot_of(e) < 0], batch)
    began = time.perf_counter()
    counts = pool.fetch(layer, experts)
    took = time.perf_counter() - began
    for e in experts:
        pool.evict(layer, e)
    return took if counts.l2_awaited == batch else None


def given_read(files: ModelFiles, pool: ExpertPool, layer: int, batch: int,
               rng: random.Random) -> tuple[float, float] | None:
    """(seconds for a pool that fills L2 to fetch `batch` experts L2 lacks, reading them itself; seconds after
    that until L2 held them all, given by its donor), None if any came another way or never reached L2."""
    index = pool.client.attachment.slot_indexes[layer]
    experts = rng.sample([e for e in range(files.n_experts) if index.slot_of(e) < 0], batch)
    began = time.perf_counter()
    counts = pool.fetch(layer, experts)
    took = time.perf_counter() - began
    deadline = began + 10
    while any(index.slot_of(e) < 0 for e in experts) and time.perf_counter() < deadline:
        time.sleep(0.0001)
    held = time.perf_counter() - began - took
    for e in experts:
        pool.evict(layer, e)
    return (took, held) if counts.l3_reads == batch and held < 10 else None


def read_as(files: ModelFiles, unit: int = READ_UNIT_BYTES, mode: str = "checked") -> None:
    """Sets the process-wide read path a config of section 4 runs with: the reader's unit and the native CRC and
    scatter switches. The pool's modes each set theirs; every other config (the filled pool shares `files`) gets
    the shipped path, not whatever the config before it left."""
    files.reader.read_unit_bytes = unit
    _native._crc32_use_library(mode in ("zlib crc", "crc after"))
    _native._scatter_straight(mode != "copied")
    _native._crc32_use_narrow(mode == "crc 128b")


def next_rows(pool: ExpertPool, layer: int, n: int) -> None:
    """Puts the n free rows the pool's next fetch would take (the ones just freed) last in line, so that round by
    round the misses land in every row, as a full pool's victims do: on a VM, rows read at different speeds
    (section 6; the part of a pool past its last whole huge page is on small pages)."""
    free = pool.layers[layer].rows.free
    free[:0] = [free.pop() for _ in range(n)]


def queue_depth(files: ModelFiles, batches: tuple[int, ...], rounds: int, seed: int) -> dict:
    """Section 4's medians: {batch: {config: (MiB/s, over raw)}}; config (threads, unit, mode), "loaders", "raw
    checked" or "load-through"."""
    rng = random.Random(seed)
    record = files.layout.nbytes
    # One pool per thread count and check: the modes that differ only in how they read share one, so that they
    # read into the same rows (on a VM, where a read lands can change its speed).
    pools = {(t, v): ExpertPool(files, capacity=max(batches), direct=True, read_threads=t, verify=v)
             for t in THREADS for v in set(MODES.values())}
    fds = files.open_fds(direct=True)
    loaders = ThreadPoolExecutor(LOADERS)
    # L2 with room for one batch a layer: the experts a round loads through evict the last round's. LRU admits every
    # give, where the learned policy may keep its victim instead of a random record (docs/decisions.md, "Admission"):
    # the filled line measures the fill, which a refused give does not make.
    daemon = DaemonProcess.serving(
        [files.path], Geometry.budget_for(files.n_layers, files.n_experts, record, max(batches)),
        "--policy", "lru", "--log-level", "warning").start()
    client = L2Client(files, daemon.socket, wait_s=5)
    through = ExpertPool(files, capacity=max(batches), client=client, load_through_s=LOAD_THROUGH_S, lend=False,
                         direct=True)
    giver_client = L2Client(files, daemon.socket, wait_s=5)
    giver = ExpertPool(files, capacity=max(batches), client=giver_client, lend=False, direct=True, fill_l2=True)
    if not giver.donor.wait_accepted(5):
        raise SystemExit(f"moe-l2d's fill desk did not take this process: {giver.donor.refused}")
    # Every destination touched once before timing: a first write into fresh pages costs page faults that a
    # running pool or daemon no longer pays.
    buf = _native.Buffer(8 * MIB)
    slots = [_native.Buffer(files.layout.span) for _ in range(max(batches))]
    raw_read(files, 8 * MIB, rng, buf)
    loaders_read(files, fds, 0, list(range(len(slots))), loaders, slots)
    for pool in [*pools.values(), through, giver]:
        for layer in range(files.n_layers):
            pool.fetch(layer, range(max(batches)))
            for e in range(max(batches)):
                pool.evict(layer, e)
    configs = ([(t, u, m) for t in THREADS for u in UNITS for m in MODES]
               + ["loaders", "raw checked", "load-through", "filled"])
    speed: dict = {b: {c: [] for c in configs} for b in batches}
    over: dict = {b: {c: [] for c in configs} for b in batches}
    to_l2: dict = {b: [] for b in batches}  # "filled": seconds after the fetch until L2 held the batch
    # "filled" over the pool's own checked read of the same round: the disk drifts from round to round
    paired: dict = {b: [] for b in batches}
    try:
        for _ in range(rounds):
            for batch in batches:
                raw = batch * record / raw_read(files, batch * record, rng, buf)
                this_round = {}
                for config in rng.sample(configs, len(configs)):
                    layer = rng.randrange(files.n_layers)
                    experts = rng.sample(range(files.n_experts), batch)
                    drop(files.files)
                    read_as(files)  # the shipped read path, for every config but the pool's modes, which set theirs
                    if config == "loaders":
                        took = loaders_read(files, fds, layer, experts, loaders, slots)
                    elif config == "raw checked":
                        took = raw_read(files, batch * record, rng, buf, check=True)
                    elif config == "load-through":
                        took = through_read(files, through, layer, batch, rng)
                        if took is None:
                            continue
                    elif config == "filled":
                        given = given_read(files, giver, layer, batch, rng)
                        if given is None:
                            continue
                        took = given[0]
                        to_l2[batch].append(given[1])
                        next_rows(giver, layer, batch)
                    else:
                        threads, unit, mode = config
                        pool = pools[threads, MODES[mode]]
                        read_as(files, unit, mode)
                        if mode == "no pool":
                            took = rows_read(files, fds, pool, layer, experts, threads)
                        else:
                            began = time.perf_counter()
                            pool.fetch(layer, experts)
                            if mode == "crc after":
                                lp = pool.layers[layer]
                                for e, r in zip(experts, lp.rows_for(experts)):
                                    files.check_record(layer, e, lp.checksum(r), "the model file")
                            took = time.perf_counter() - began
                            for e in experts:
                                pool.evict(layer, e)
                        next_rows(pool, layer, batch)
                    speed[batch][config].append(batch * record / took)
                    over[batch][config].append(batch * record / took / raw)
                    this_round[config] = batch * record / took
                if "filled" in this_round:
                    paired[batch].append(this_round["filled"] / this_round[READ_THREADS, READ_UNIT_BYTES, "checked"])
    finally:
        read_as(files)
        loaders.shutdown()
        for pool in [*pools.values(), through, giver]:
            pool.close()
        client.close()
        giver_client.close()
        daemon.cleanup()
        for fd in fds:
            os.close(fd)
    out = {b: {c: (statistics.median(speed[b][c]), statistics.median(over[b][c])) for c in configs}
           for b in batches}
    for b in batches:
        out[b]["filled, to L2 s"] = statistics.median(to_l2[b])
        out[b]["filled over checked"] = statistics.median(paired[b])
    return out


def straight_vs_copied(files: ModelFiles, batches: tuple[int, ...], rounds: int, seed: int) -> None:
    """Section 5: warm buffered misses of the packed model, straight into the rows vs copied via the scratch."""
    rng = random.Random(seed)
    warm(files.files)
    print(f"\n5. warm buffered misses of the packed model (the file in the page cache; median of {rounds * 3} "
          "interleaved fetches): read straight into the rows against read into the scratch and copied")
    for threads in (1, 4):
        with ExpertPool(files, capacity=max(batches), direct=False, read_threads=threads, verify="file") as pool:
            for layer in range(files.n_layers):  # every row touched once before timing, as in section 4
                pool.fetch(layer, range(max(batches)))
                for e in range(max(batches)):
                    pool.evict(layer, e)
            for batch in batches:
                speed: dict = {True: [], False: []}
                try:
                    for _ in range(rounds * 3):
                        for straight in rng.sample([True, False], 2):
                            layer = rng.randrange(files.n_layers)
                            experts = rng.sample(range(files.n_experts), batch)
                            _native._scatter_straight(straight)
                            began = time.perf_counter()
                            pool.fetch(layer, experts)
                            speed[straight].append(batch * files.layout.nbytes / (time.perf_counter() - began))
                            for e in experts:
                                pool.evict(layer, e)
                finally:
                    _native._scatter_straight(True)
                into, via = statistics.median(speed[True]), statistics.median(speed[False])
                print(f"  {batch} miss{'es' if batch > 1 else ''}, {threads} thr: straight {into / MIB:.0f} MiB/s, "
                      f"copied {via / MIB:.0f} MiB/s: {into / via:.2f}x")


def physical_runs(buffer, nbytes: int) -> int | None:
    """How many physically contiguous runs the first nbytes of buffer's pages form; None without pagemap."""
    import struct

    address = buffer.address
    try:
        with open("/proc/self/pagemap", "rb") as f:
            frames = []
            for page in range(0, nbytes, 4096):
                f.seek((address + page) // 4096 * 8)
                frames.append(struct.unpack("Q", f.read(8))[0] & ((1 << 55) - 1))
    except OSError:
        return None
    if not any(frames):  # not root: the frame numbers read as zero
        return None
    return 1 + sum(1 for a, b in zip(frames, frames[1:]) if b != a + 1)


def l2_segments(nbytes: int, n: int) -> list:
    """n shared-memory segments made as moe-l2d makes L2's (Segment.create), their names unlinked at once."""
    segments = []
    for i in range(n):
        name = f"/ml2bio{os.getpid()}.{i}"
        segments.append(_native.Segment.create(name, nbytes))
        _native.Segment.unlink(name)
    return segments


def destinations(files: ModelFiles, rounds: int, seed: int, n: int = 8) -> None:
    """Section 6: one record read cold into each of n buffers and two L2 segments, by their physical contiguity."""
    rng = random.Random(seed)
    record = files.layout.span
    # Large buffers, half of them made after others were made and freed (as a pool's rows are, growing), each
    # touched as rows are; the record lands at the start of each.
    early = [_native.Buffer(8 * record) for _ in range(n // 2)]
    freed = [_native.Buffer(8 * record) for _ in range(4 * n)]
    del freed
    buffers = early + [_native.Buffer(8 * record) for _ in range(n - n // 2)]
    for buffer in buffers:
        buffer.view()[:] = bytes(8 * record)
    # Where a miss read straight into an offered slot would land (docs/decisions.md, "Fills").
    buffers += l2_segments(8 * record, 2)
    n = len(buffers)
    fds = files.open_fds(direct=True)
    # Each read as moe-l2d's loaders read (one read on one thread) and as a client reads its misses (on its read
    # threads, checked as it lands), in turns.
    reads = {
        "loader": lambda layer, expert, memory: files.read_into_slots(fds, layer, [(expert, memory, 0, record)],
                                                                      threads=1),
        "client": lambda layer, expert, memory: files.read_into_rows(
            fds, layer, [(expert, [(memory, p.offset) for p in files.layout.pieces])], threads=READ_THREADS,
            checksums=True),
    }
    speed = {(i, how): [] for i in range(n) for how in reads}
    try:
        for _ in range(rounds):
            for i, how in rng.sample(list(speed), len(speed)):
                layer, expert = rng.randrange(files.n_layers), rng.randrange(files.n_experts)
                drop(files.files)
                began = time.perf_counter()
                reads[how](layer, expert, buffers[i])
                speed[i, how].append(record / (time.perf_counter() - began))
    finally:
        for fd in fds:
            os.close(fd)
    print(f"\n6. one {format_size(record)} record read cold, direct, into each of {n - 2} buffers and 2 L2 segments "
          f"(median of {rounds}): MiB/s as moe-l2d's loaders read it (one thread) and as a client does "
          f"({READ_THREADS} threads, checked), by the physically contiguous runs of the memory's pages")
    median = {key: statistics.median(seen) / MIB for key, seen in speed.items()}
    for i in sorted(range(n), key=lambda i: median[i, "loader"]):
        runs = physical_runs(buffers[i], record)
        kind = "L2 segment" if isinstance(buffers[i], _native.Segment) else "Buffer"
        print(f"  {median[i, 'loader']:6.0f} {median[i, 'client']:6.0f} MiB/s  {kind:10s}  "
              + (f"{runs} runs of {record // 4096} pages" if runs else "(runs: needs /proc/self/pagemap as root)"))


def print_queue_depth(files: ModelFiles, result: dict, rounds: int) -> None:
    print(f"\n4. cold direct misses of the packed model, {format_size(files.layout.nbytes)} records (median of "
          f"{rounds} interleaved rounds; MiB/s, and over a raw sequential direct read of the same bytes in the "
          "same round):")
    for batch, row in result.items():
        print(f"  {batch} miss{'es' if batch > 1 else ''} at a time:")
        print(f"    {'':16s}" + "".join(f"{format_size(u) + ' units':>20s}" for u in UNITS))
        for mode in MODES:
            for threads in THREADS:
                print(f"    {mode:9s} {threads} thr  " + "".join(
                    f"{row[threads, u, mode][0] / MIB:11.0f} {row[threads, u, mode][1]:5.2f}x  " for u in UNITS))
        print(f"    moe-l2d's {LOADERS} loaders (one read a record): {row['loaders'][0] / MIB:.0f} MiB/s, "
              f"{row['loaders'][1]:.2f}x")
        print(f"    the raw read, each 8 MiB read checksummed after it lands (what a check costs where it cannot "
              f"overlap a read): {row['raw checked'][0] / MIB:.0f} MiB/s, {row['raw checked'][1]:.2f}x")
        print(f"    load-through, a real moe-l2d reading into L2 and the pool copying (report and wake-up "
              f"included): {row['load-through'][0] / MIB:.0f} MiB/s, {row['load-through'][1]:.2f}x")
        print(f"    filled, the pool reading its misses and giving them to the same moe-l2d: "
              f"{row['filled'][0] / MIB:.0f} MiB/s, {row['filled'][1]:.2f}x, {row['filled over checked']:.2f}x the "
              f"pool's own checked read of the same round ({READ_THREADS} thr, {format_size(READ_UNIT_BYTES)} units; "
              f"median of the rounds' ratios); L2 held them {row['filled, to L2 s'] * 1e3:.2f} ms after the fetch")


def make_cgroup(limit: int):
    """A memory cgroup limited to `limit` bytes: (the file a process writes its pid to, cleanup), or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    name = f"moe-l2-bench-{os.getpid()}"
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            group = v1 / name
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit))
        elif "memory" in (v2 / "cgroup.controllers").read_text().split():
            group = v2 / name
            group.mkdir()
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
        else:
            return None
    except OSError:
        return None

    def cleanup():
        for _ in range(50):
            try:
                group.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    return str(group / "cgroup.procs"), cleanup


def page_cache_experiment(model: ModelFiles, work: Path, cgroup_mb: int) -> None:
    unrelated = work / "unrelated.bin"
    size = cgroup_mb * MIB // 2
    with open(unrelated, "wb") as f:
        for _ in range(size // MIB):
            f.write(os.urandom(MIB))
    model_bytes = sum(p.stat().st_size for p in model.files)
    for direct in (False, True):
        group = make_cgroup(cgroup_mb * MIB)
        try:
            out = subprocess.run([sys.executable, "-P", "-c", STREAM, str(model.path), str(unrelated),
                                  "1" if direct else "0", group[0] if group else ""],
                                 capture_output=True, text=True, check=True)
        finally:
            if group:
                group[1]()
        r = json.loads(out.stdout.strip().splitlines()[-1])
        where = f"in a {cgroup_mb} MiB memory cgroup" if group else "without a memory limit (not root on Linux)"
        print(f"  {'direct  ' if direct else 'buffered'}: streamed {format_size(r['model'])} of experts {where}: "
              f"unrelated file cached {r['before'] / r['unrelated']:.0%} before, {r['after'] / r['unrelated']:.0%} "
              f"after; model left in page cache: {format_size(r['model_cached'])} "
              f"({r['model_cached'] / model_bytes:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an mlx-lm MoE checkpoint to use (default: make one), or a packed "
                        "model with --queue-depth-only (the synthetic ones of `moe-l2 bench --geometry` are)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe-hidden", type=int, default=768)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cgroup-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15, help="section 4's interleaved rounds")
    parser.add_argument("--queue-depth-only", action="store_true",
                        help="run sections 4 to 6 alone (the packed model's read path)")
    parser.add_argument("--keep", type=Path, help="keep the made and packed models in this directory")
    args = parser.parse_args()
    if not hasattr(os, "posix_fadvise"):
        sys.exit("bench_io needs posix_fadvise (Linux) to read cold")

    work = args.keep or Path(tempfile.mkdtemp(prefix="ml2io-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = args.model
        if src is None:
            src = work / "stacked"
            if not (src / "config.json").exists():
                print(f"making a {args.layers}-layer x {args.experts}-expert 4-bit mixtral ({args.hidden}/"
                      f"{args.moe_hidden}) in {src} ...", flush=True)
                make_model(src, "mixtral", layers=args.layers, experts=args.experts, top_k=args.batch,
                           hidden_size=args.hidden, moe_hidden_size=args.moe_hidden, bits=4)
        stacked = ModelFiles.open(src)
        packed_dir = work / "packed"
        if stacked.layout.packed:
            if not args.queue_depth_only:
                sys.exit(f"{src} is packed already: sections 1-3 compare it with the checkpoint it was packed "
                         "from; give that, or add --queue-depth-only")
            packed = stacked
        elif (packed_dir / "config.json").exists():
            packed = ModelFiles.open(packed_dir)
        else:
            packed = pack(src, packed_dir, moe_l2_only=True, verify="none", progress=False)
        print(f"model: {stacked.n_layers} MoE layers x {stacked.n_experts} experts, record "
              f"{format_size(stacked.layout.nbytes)} ({len(stacked.layout.pieces)} pieces); files in {work} "
              f"({shutil.disk_usage(work).free // MIB} MiB free there)\n")

        if not args.queue_depth_only:
            layouts(stacked, packed, work, args)
        batches = (1, args.batch)
        print_queue_depth(packed, queue_depth(packed, batches, args.rounds, seed=4), args.rounds)
        straight_vs_copied(packed, batches, args.rounds, seed=5)
        destinations(packed, args.rounds, seed=6)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def layouts(stacked: ModelFiles, packed: ModelFiles, work: Path, args) -> None:
    """Sections 1-3."""
    seq = {}
    for name, files in (("stacked", stacked), ("packed", packed)):
        for direct, streams in ((False, 1), (True, 1), (True, 4)):
            seq[name, direct, streams] = sequential(files.files, direct, streams)
    print("1. sequential read of the files, 8 MiB reads, cold:")
    for (name, direct, streams), speed in seq.items():
        print(f"  {name:8s} {'direct  ' if direct else 'buffered'} {streams} stream{'s' if streams > 1 else ' '}"
              f" {speed / MIB:8.0f} MiB/s")
    reference = max(seq.values())

    rows = [("stacked", stacked, False), ("stacked", stacked, True), ("packed", packed, False),
            ("packed", packed, True)]
    print(f"\n2. miss cost per expert (median of {args.samples} fetches; MiB/s = record bytes / time; "
          f"x seq = that over the best sequential speed, {reference / MIB:.0f} MiB/s):")
    print(f"  {'':8s} {'':8s} " + "".join(f"{c:>28s}" for c in
                                          ("cold 1", f"cold {args.batch}", "warm 1", f"warm {args.batch}")))
    for name, files, direct in rows:
        cells = []
        for cold, batch in ((True, 1), (True, args.batch), (False, 1), (False, args.batch)):
            t = miss_cost(files, direct, cold, batch, args.samples, seed=batch)
            bw = files.layout.nbytes / t
            cells.append(f"{t * 1e6:9.0f} us {bw / MIB:6.0f} MiB/s {bw / reference:4.2f}x")
        print(f"  {name:8s} {'direct  ' if direct else 'buffered'} " + "".join(f"{c:>28s}" for c in cells))

    print(f"\n3. page cache of an unrelated {args.cgroup_mb // 2} MiB file around streaming every expert:")
    page_cache_experiment(packed, work, args.cgroup_mb)


if __name__ == "__main__":
    main()
