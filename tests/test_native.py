"""moe_l2._native on real objects: MLX-backed buffers, shared memory, seqlock copies, preads."""

import contextlib
import errno
import itertools
import os
import platform
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import _posixshmem
import mlx.core as mx
import pytest

from moe_l2 import _native as native
from moe_l2.layout import LAYOUT_VERSION, Geometry

from .conftest import FUTEX_SYSCALL, pages_mapped, sleeping_on, wait_for

PAGE = os.sysconf("SC_PAGESIZE")
_names = itertools.count()


@pytest.fixture
def shm_name():
    """Yields a fresh segment-name factory; every name it gave is unlinked afterwards."""
    names = []

    def make():
        names.append(f"/moe-l2-t{os.getpid()}-{next(_names)}")
        return names[-1]

    yield make
    for name in names:
        native.Segment.unlink(name)


# --- Buffer -----------------------------------------------------------------------------


def test_buffer_is_zeroed_page_aligned_memory():
    buf = native.Buffer(3 * PAGE + 5)
    assert isinstance(buf, native.Memory)
    assert buf.nbytes == 3 * PAGE + 5
    assert buf.address % PAGE == 0
    assert not buf.readonly
    assert bytes(buf.view()) == bytes(buf.nbytes)
    with pytest.raises(TypeError):
        native.Memory()
    with pytest.raises(ValueError, match=r"\[Buffer\] nbytes must be > 0"):
        native.Buffer(0)


HUGE = 2 << 20


def mapping_at(address: int) -> dict[str, int]:
    """The numeric fields (AnonHugePages in bytes, THPeligible...) of the mapping that holds address
    (/proc/self/smaps)."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head, *rest = line.split()
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and rest and rest[0].isdigit():
                fields[head.rstrip(":")] = int(rest[0]) * (1024 if rest[1:] == ["kB"] else 1)
    return fields


def thp_fallbacks() -> int:
    """How often the kernel gave small pages where a huge page was asked for, having no free 2 MiB block."""
    with open("/proc/vmstat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


@pytest.mark.skipif(sys.platform != "linux" or mx.cuda.is_available(),
                    reason="transparent huge pages are Linux's, and CUDA's managed memory is left as it comes")
def test_large_buffers_start_on_a_huge_page_and_get_huge_pages_where_the_kernel_gives_them():
    """Buffers the reads land in (pool rows, the scratch) ask for huge pages before their first touch: a direct
    read into them is one physically contiguous run per 2 MiB (docs/architecture.md, "Native module")."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().split("[")[1].split("]")[0]
    fallbacks = thp_fallbacks()
    small, large, host = native.Buffer(HUGE - PAGE), native.Buffer(3 * HUGE + 5), native.HostBuffer(4 * HUGE)
    assert large.address % HUGE == 0 and bytes(large.view()) == bytes(large.nbytes)
    assert small.address % PAGE == 0  # below a huge page: a page boundary, as ever
    if mode == "never":
        pytest.skip("transparent huge pages are off on this machine (always/madvise/never: never)")
    host.view()[:] = b"\1" * host.nbytes
    for buf in (large, host):
        assert mapping_at(buf.address)["THPeligible"] == 1  # asked for (madvise), whatever the kernel then gives
    # The kernel gives huge pages while it has free 2 MiB blocks; a machine whose memory is fragmented (after hours of
    # benches) falls back to small pages, and counts it.
    if thp_fallbacks() == fallbacks:
        assert mapping_at(large.address)["AnonHugePages"] >= 2 * HUGE
        assert mapping_at(host.address)["AnonHugePages"] >= 2 * HUGE


@pytest.mark.parametrize("dtype", [mx.uint8, mx.int32, mx.float32, mx.bfloat16, mx.float16])
def test_buffer_array_is_an_mlx_array_of_the_asked_shape(dtype):
    buf = native.Buffer(4096)
    arr = buf.array(128, [3, 4, 5], dtype)
    assert type(arr) is mx.array
    assert arr.shape == (3, 4, 5)
    assert arr.dtype == dtype
    assert mx.all(arr == 0).item()


def test_writes_through_view_are_seen_by_mlx_ops():
    buf = native.Buffer(PAGE)
    rows = buf.array(64, [4, 8], mx.float32)
    other = buf.array(0, [16], mx.int32)
    assert mx.sum(rows).item() == 0
    floats = buf.view().cast("f")
    floats[16] = 5.0  # rows[0, 0]: byte 64
    floats[16 + 31] = 2.5  # rows[3, 7]
    assert mx.sum(rows).item() == 7.5
    assert rows[3, 7].item() == 2.5
    buf.view().cast("i")[15] = -7  # other[15], bytes just before rows
    assert other[15].item() == -7
    assert mx.sum(rows).item() == 7.5


def test_array_outlives_the_buffer_object():
    buf = native.Buffer(PAGE)
    buf.view().cast("i")[:4] = memoryview(bytes(range(1, 17))).cast("i")
    arr = buf.array(0, [16], mx.uint8)
    del buf
    mx.synchronize()
    assert arr.tolist() == list(range(1, 17))
    assert mx.sum(arr * 2).item() == 2 * sum(range(1, 17))


def test_buffer_array_bounds_are_checked():
    buf = native.Buffer(256)
    buf.array(192, [16], mx.float32)  # exactly to the end
    with pytest.raises(ValueError, match=r"\[Buffer.array\] bytes \[196, 260\) are outside"):
        buf.array(196, [16], mx.float32)
    with pytest.raises(ValueError, match=r"\[Buffer.array\] offset 2 is not a multiple"):
        buf.array(2, [4], mx.float32)
    with pytest.raises(ValueError, match=r"\[Buffer.array\] offset must be >= 0"):
        buf.array(-4, [4], mx.float32)
    with pytest.raises(ValueError, match=r"\[Buffer.array\] shape dimension -1"):
        buf.array(0, [-1, 4], mx.float32)
    with pytest.raises(ValueError, match=r"\[Buffer.array\] size overflow"):
        buf.array(0, [2**31 - 1] * 3, mx.float32)
    # Strided: the last element of the last row bounds it, not rows times the row's size.
    buf.array(0, [3, 4], mx.float32, strides=[24, 1])  # rows 96 bytes apart: items 0..51, 208 bytes
    with pytest.raises(ValueError, match=r"\[Buffer.array\] bytes \[64, 272\) are outside"):
        buf.array(64, [3, 4], mx.float32, strides=[24, 1])
    with pytest.raises(ValueError, match=r"\[Buffer.array\] shape and strides must be of one length"):
        buf.array(0, [3, 4], mx.float32, strides=[24])
    with pytest.raises(ValueError, match=r"\[Buffer.array\] stride must be >= 0"):
        buf.array(0, [3, 4], mx.float32, strides=[-4, 1])


# --- HostBuffer -------------------------------------------------------------------------


def test_host_buffer_is_zeroed_page_aligned_memory_that_native_reads_fill(tmp_path):
    path = tmp_path / "data"
    payload = os.urandom(3 * PAGE + 5)
    path.write_bytes(payload)
    buf = native.HostBuffer(4 * PAGE)
    assert isinstance(buf, native.Memory) and not isinstance(buf, native.Buffer)
    assert buf.nbytes == 4 * PAGE and buf.address % PAGE == 0 and not buf.readonly
    assert bytes(buf.view()) == bytes(buf.nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        native.pread_records([(fd, 0, len(payload), buf, 7)], threads=2)
    finally:
        os.close(fd)
    assert bytes(buf.view()[7:7 + len(payload)]) == payload
    with pytest.raises(ValueError, match=r"\[HostBuffer\] nbytes must be > 0"):
        native.HostBuffer(0)


# --- Segment ----------------------------------------------------------------------------


def test_segment_create_open_unlink_round_trip(shm_name):
    name = shm_name()
    seg = native.Segment.create(name, 2 * PAGE)
    assert (seg.name, seg.nbytes, seg.readonly, seg.closed) == (name, 2 * PAGE, False, False)
    assert bytes(seg.view()) == bytes(2 * PAGE)
    seg.view()[100:104] = b"moe!"

    reader = native.Segment.open(name)
    assert reader.readonly and reader.nbytes == 2 * PAGE
    assert reader.address != seg.address
    assert bytes(reader.view()[100:104]) == b"moe!"

    writer = native.Segment.open(name, readonly=False)
    writer.store_u32(8, 0xDEADBEEF)
    assert reader.load_u32(8) == 0xDEADBEEF

    assert native.Segment.unlink(name) is True
    assert native.Segment.unlink(name) is False
    # Mappings outlive the name.
    assert bytes(reader.view()[100:104]) == b"moe!"
    with pytest.raises(FileNotFoundError, match=r"\[Segment.open\] cannot open .*: No such file"):
        native.Segment.open(name)


def test_segment_create_applies_the_mode_exactly(shm_name):
    name = shm_name()
    old = os.umask(0o077)
    try:
        native.Segment.create(name, PAGE, mode=0o640)
    finally:
        os.umask(old)
    # fstat of the object itself: macOS has no /dev/shm to stat it in.
    fd = _posixshmem.shm_open(name, os.O_RDONLY, 0)
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o640
    finally:
        os.close(fd)


def test_readonly_segment_rejects_writes(shm_name):
    name = shm_name()
    native.Segment.create(name, PAGE)
    ro = native.Segment.open(name)
    view = ro.view()
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1
    with pytest.raises(ValueError, match=r"\[Memory.store_u32\] segment '.*' is read-only"):
        ro.store_u32(0, 1)


@pytest.mark.parametrize("name", ["/" + "x" * 31, "noslash", "/a/b", "/", ""])
def test_bad_segment_names_are_rejected(name):
    for call in (
        lambda: native.Segment.create(name, PAGE),
        lambda: native.Segment.open(name),
        lambda: native.Segment.unlink(name),
    ):
        with pytest.raises(ValueError, match=r"invalid segment name .*\(31 in all, the macOS limit\)"):
            call()


def test_longest_segment_name_works(shm_name):
    name = shm_name()
    name += "x" * (31 - len(name))
    try:
        seg = native.Segment.create(name, PAGE)
        assert seg.name == name
    finally:
        assert native.Segment.unlink(name)


def test_duplicate_create_fails_clearly(shm_name):
    name = shm_name()
    native.Segment.create(name, PAGE)
    with pytest.raises(FileExistsError) as info:
        native.Segment.create(name, PAGE)
    assert info.value.errno == errno.EEXIST
    message = str(info.value)
    assert message.startswith("[Segment.create] cannot create shared-memory segment '" + name)
    assert "unlink it first" in message


def test_segment_close_is_idempotent_and_views_stay_valid(shm_name):
    seg = native.Segment.create(shm_name(), PAGE)
    view = seg.view()
    view[:3] = b"abc"
    seg.close()
    seg.close()
    assert seg.closed
    assert bytes(view[:3]) == b"abc"  # the export keeps the mapping
    with pytest.raises(ValueError, match=r"\[Memory.load_u32\] segment .* is closed"):
        seg.load_u32(0)
    with pytest.raises(BufferError, match="is closed"):
        seg.view()


def test_segment_size_errors(shm_name):
    with pytest.raises(ValueError, match=r"\[Segment.create\] nbytes must be > 0"):
        native.Segment.create(shm_name(), 0)
    with pytest.raises(ValueError, match=r"\[Segment.create\] mode must be"):
        native.Segment.create(shm_name(), PAGE, mode=0o1777)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")
@pytest.mark.parametrize("touch", [False, True], ids=["madvise", "touch"])
def test_prefault_maps_a_range_for_writing_and_changes_no_byte(shm_name, touch):
    """A mapping opened here faults on every page it first writes; prefault maps a range ahead (the donor's slot
    offered while its read runs: client/donor.py), by MADV_POPULATE_WRITE or, as on macOS, a touch of each page."""
    name = shm_name()
    owner = native.Segment.create(name, 16 * PAGE)
    pattern = random.Random(7).randbytes(16 * PAGE)
    owner.view()[:] = pattern
    writer = native.Segment.open(name, readonly=False)
    assert pages_mapped(writer.address, 16 * PAGE) == 0
    native._prefault_by_touch(touch)
    try:
        writer.prefault(4 * PAGE, 8 * PAGE)
    finally:
        native._prefault_by_touch(False)
    assert pages_mapped(writer.address + 4 * PAGE, 8 * PAGE) == 8
    assert pages_mapped(writer.address, 4 * PAGE) == pages_mapped(writer.address + 12 * PAGE, 4 * PAGE) == 0
    assert bytes(owner.view()) == pattern


def test_prefault_refuses_a_readonly_mapping_and_a_range_off_the_pages(shm_name):
    name = shm_name()
    native.Segment.create(name, 4 * PAGE)
    with pytest.raises(ValueError, match=r"\[Segment.prefault\] segment .* is closed or read-only"):
        native.Segment.open(name).prefault(0, PAGE)
    writer = native.Segment.open(name, readonly=False)
    for offset, nbytes in ((1, PAGE), (0, PAGE + 1), (4 * PAGE, PAGE), (0, 5 * PAGE), (-PAGE, PAGE)):
        with pytest.raises(ValueError, match=r"\[Segment.prefault\] (range|offset)"):
            writer.prefault(offset, nbytes)


# --- atomics ---------------------------------------------------------------------------


def test_atomic_loads_and_stores():
    buf = native.Buffer(64)
    buf.store_u32(4, 2**32 - 1)
    buf.store_i32(8, -5)
    assert buf.load_u32(4) == 2**32 - 1
    assert buf.load_i32(4) == -1
    assert buf.load_i32(8) == -5
    with pytest.raises(ValueError, match=r"\[Memory.load_u32\] offset 2 is not 4-byte aligned"):
        buf.load_u32(2)
    with pytest.raises(ValueError, match=r"\[Memory.store_i32\] bytes \[64, 68\) are outside"):
        buf.store_i32(64, 0)


# --- SlotIndex: the slot format and its seqlock -----------------------------------------


META = "<iIII"  # a slot's metadata as docs/architecture.md ("Shared memory") gives it: expert, seq, checksum, reserved


class Store:
    """A small L2 store laid out as docs/architecture.md ("Shared memory") says: a 64-byte header stand-in, slot_of,
    the slots' metadata, written through SlotIndex as the daemon writes. Word 0 tells a writer process to stop."""

    SLOT_OF = 64

    def __init__(self, names, n_experts=8, n_slots=4, stride=2 * PAGE):
        self.n_experts, self.n_slots, self.stride = n_experts, n_slots, stride
        self.meta = self.SLOT_OF + native.SlotIndex.SLOT_OF_BYTES * n_experts
        self.index = native.Segment.create(names(), self.meta + native.SlotIndex.META_BYTES * n_slots)
        self.data = native.Segment.create(names(), n_slots * stride)
        self.slots = self.slot_index(self.index)
        self.slots.clear()

    def slot_index(self, index, data=None, **layout):
        args = dict(slot_of_offset=self.SLOT_OF, meta_offset=self.meta, n_experts=self.n_experts,
                    n_slots=self.n_slots, slot_stride=self.stride)
        return native.SlotIndex(index, data or self.data, **{**args, **layout})

    def fill(self, slot, expert, record, checksum=0):
        old = self.slots.meta(slot)[0]
        evicted = old if old >= 0 and self.slots.slot_of(old) == slot else -1
        self.slots.begin_fill(slot, evicted)
        self.data.view()[slot * self.stride : slot * self.stride + len(record)] = record
        return self.slots.finish_fill(slot, expert, checksum)

    def copy(self, pieces, experts, rows, index=None, threads=1):
        slots = self.slots if index is None else self.slot_index(index)
        return slots.copy(pieces, experts, rows, threads)


def test_layout_places_the_index_with_slot_index_sizes():
    """The sizes layout.py places the index with are SlotIndex's, and lay a served model's index out as before
    (layout version 3: as 2, slot_of also saying which records are coming in): slot_of int32 entries, 16-byte
    metadata."""
    assert (native.SlotIndex.SLOT_OF_BYTES, native.SlotIndex.META_BYTES, LAYOUT_VERSION) == (4, 16, 3)
    g = Geometry(n_layers=3, n_experts=10, n_slots=5, record_bytes=100)
    assert g.slot_of_offset(2) - g.slot_of_offset(1) == 40
    assert g.meta_offset(1) - g.meta_offset(0) == 80 and g.meta_base % 64 == 0


def test_slot_index_fills_read_back_byte_exact(shm_name):
    """What the writer side publishes is what every reader side sees: the record's bytes (copy, and lend's slot
    read in place), the slot's metadata, slot_of; an evicted expert is unmapped."""
    store = Store(shm_name)
    records = {e: os.urandom(store.stride) for e in (2, 7)}
    assert store.fill(0, 2, records[2], checksum=0xDEADBEEF) == 2
    assert store.fill(3, 7, records[7], checksum=5) == 2
    assert store.slots.meta(0) == (2, 2, 0xDEADBEEF) and store.slots.meta(3) == (7, 2, 5)
    assert [store.slots.slot_of(e) for e in range(store.n_experts)] == [-1, -1, 0, -1, -1, -1, -1, 3]
    # The bytes are the documented layout (the format of layout version 3, which clients of other builds read).
    index = store.index.view()
    assert struct.unpack_from("<8i", index, store.SLOT_OF) == (-1, -1, 0, -1, -1, -1, -1, 3)
    assert [struct.unpack_from(META, index, store.meta + 16 * slot) for slot in range(4)] == \
        [(2, 2, 0xDEADBEEF, 0), (-1, 0, 0, 0), (-1, 0, 0, 0), (7, 2, 5, 0)]
    pool = native.Buffer(2 * store.stride)
    assert store.copy([(0, store.stride, pool, store.stride)], [7, 2], [0, 1]) == [True, True]
    assert bytes(pool.view()[: store.stride]) == records[7]
    assert bytes(pool.view()[store.stride :]) == records[2]
    lent = store.slots.lend([2, 7, 1])
    assert lent == [(0, 2), (3, 2), (-1, 0)]
    data = store.data.view()
    for (slot, _), e in zip(lent, (2, 7)):
        assert bytes(data[slot * store.stride : (slot + 1) * store.stride]) == records[e]
    assert store.slots.check([0, 3], [2, 2]) == [True, True]
    # Slot 0 refilled with expert 5: expert 2 is gone, its old loan fails the check, expert 5 reads back.
    record = os.urandom(store.stride)
    assert store.fill(0, 5, record) == 4
    assert store.slots.slot_of(2) == -1 and store.slots.meta(0) == (5, 4, 0)
    assert store.slots.lend([2, 5]) == [(-1, 0), (0, 4)]
    assert store.copy([(0, store.stride, pool, store.stride)], [5, 2], [0, 1]) == [True, False]
    assert bytes(pool.view()[: store.stride]) == record


def test_slot_index_refuses_a_fill_in_progress(shm_name):
    """Between begin_fill and finish_fill neither copy nor lend hands out the slot, not even for the expert
    slot_of still names (a refill of its own slot); abort_fill leaves the slot empty."""
    store = Store(shm_name)
    store.fill(1, 4, b"\x04" * 64)
    pool = native.Buffer(64)
    pieces = [(0, 64, pool, 64)]
    assert store.slots.begin_fill(1) == 3  # expert 4 is not evicted: slot_of still points at slot 1
    assert store.slots.slot_of(4) == 1 and store.slots.meta(1) == (-1, 3, 0)
    assert store.copy(pieces, [4], [0]) == [False]
    assert store.slots.lend([4]) == [(-1, 3)]
    with pytest.raises(RuntimeError, match=r"\[SlotIndex.begin_fill\] slot 1 has an odd seq \(3\): a fill is "
                                           r"already in progress"):
        store.slots.begin_fill(1)
    assert store.slots.abort_fill(1) == 4
    assert store.slots.meta(1) == (-1, 4, 0)
    assert store.copy(pieces, [4], [0]) == [False]  # empty: slot_of names a slot that holds no expert
    assert store.slots.lend([4]) == [(-1, 4)]
    for finish in (lambda: store.slots.finish_fill(1, 4, 0), lambda: store.slots.abort_fill(1)):
        with pytest.raises(RuntimeError, match=r"is not being filled \(seq 4 is even\): begin_fill first"):
            finish()
    assert store.fill(1, 4, b"\x09" * 64) == 6
    assert store.copy(pieces, [4], [0]) == [True] and bytes(pool.view()) == b"\x09" * 64


def test_a_loan_invalidated_by_a_later_fill_fails_check(shm_name):
    """check is True only while the lent slot has the seq it was lent with: a fill begun since (even one that was
    aborted, or refilled the same expert) makes it False for good."""
    store = Store(shm_name)
    store.fill(0, 1, b"\x01" * 64)
    store.fill(2, 3, b"\x03" * 64)
    (slot1, seq1), (slot3, seq3) = store.slots.lend([1, 3])
    assert store.slots.check([slot1, slot3], [seq1, seq3]) == [True, True]
    store.slots.begin_fill(slot1)
    assert store.slots.check([slot1, slot3], [seq1, seq3]) == [False, True]  # mid-fill
    store.slots.finish_fill(slot1, 1)
    assert store.slots.check([slot1, slot3], [seq1, seq3]) == [False, True]  # same expert, new record
    store.slots.begin_fill(slot3, evicted=3)
    store.slots.abort_fill(slot3)
    assert store.slots.check([slot1, slot3], [seq1, seq3]) == [False, False]
    assert store.slots.check([], []) == []


def test_slot_index_seq_wraps_to_even(shm_name):
    store = Store(shm_name)
    store.index.store_u32(store.meta + 4, 2**32 - 2)  # slot 0's seq (META, the documented layout)
    assert store.slots.begin_fill(0) == 2**32 - 1
    assert store.slots.finish_fill(0, 6) == 0
    assert store.slots.lend([6]) == [(0, 0)]


def test_a_record_coming_in_is_named_in_slot_of_and_absent_to_every_reader(shm_name):
    """begin_fill with the incoming expert says in slot_of that its record is coming into that slot (-(slot + 2),
    the documented bytes); copy and lend pass it by as absent; finish_fill publishes it, abort_fill makes it absent
    again, but only while slot_of still names that fill. wait returns at once for what is not coming, and at its
    timeout for what stays coming (a writer that died mid-fill)."""
    store = Store(shm_name)
    store.fill(0, 3, b"\x03" * 64)
    assert store.slots.begin_fill(2, incoming=5) == 1
    store.slots.begin_fill(0, evicted=3, incoming=6)
    assert struct.unpack_from("<8i", store.index.view(), store.SLOT_OF) == (-1, -1, -1, -1, -1, -4, -2, -1)
    assert (store.slots.slot_of(5), store.slots.slot_of(3)) == (-4, -1)
    pool = native.Buffer(64)
    assert store.copy([(0, 64, pool, 64)], [5, 6], [0, 0]) == [False, False]
    assert store.slots.lend([5, 6]) == [(-1, 0), (-1, 0)]
    assert store.slots.wait([1, 3], 600) == [False, False]  # absent, not coming: nothing to wait for
    assert store.slots.wait([5, 1], 0.01) == [True, False]  # still coming at the timeout
    assert store.slots.slot_of(5) == -4
    store.slots.finish_fill(2, 5)
    store.slots.abort_fill(0, incoming=6)
    assert [store.slots.slot_of(e) for e in (5, 6)] == [2, -1]
    assert store.slots.wait([5, 6], 600) == [False, False]
    store.slots.begin_fill(1)
    store.slots.abort_fill(1, incoming=5)  # 5 is not coming into slot 1: its slot_of stays
    assert store.slots.slot_of(5) == 2 and store.copy([(0, 64, pool, 64)], [5], [0]) == [True]
    with pytest.raises(ValueError, match=r"\[SlotIndex.begin_fill\] incoming = 8 is outside \[0, 8\)"):
        store.slots.begin_fill(3, incoming=8)
    with pytest.raises(ValueError, match=r"\[SlotIndex.wait\] experts\[1\] = -1 is outside \[0, 8\)"):
        store.slots.wait([0, -1], 1)
    with pytest.raises(ValueError, match=r"\[SlotIndex.wait\] timeout_s must be >= 0"):
        store.slots.wait([0], float("nan"))


# A client process, as ExpertPool waits: the index mapped read-only, one expert's slot_of waited on.
WAITER = """
import sys
from moe_l2 import _native as native
index = native.Segment.open(sys.argv[1], readonly=True)
slot_of_offset, meta_offset, expert, absent = map(int, sys.argv[2:6])
slots = native.SlotIndex(index, None, slot_of_offset=slot_of_offset, meta_offset=meta_offset, n_experts=8,
                         n_slots=4, slot_stride=0)
print(index.address + slot_of_offset + 4 * expert, flush=True)
print(slots.wait([expert], 600, bool(absent))[0], slots.slot_of(expert), flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux" or FUTEX_SYSCALL is None, reason="reads a futex wait in /proc")
@pytest.mark.parametrize("end", ["published", "aborted", "absent, then published"])
def test_a_waiter_in_another_process_sleeps_on_slot_of_until_the_writer_wakes_it(shm_name, end):
    """Another process waits for expert 5 with a 600 s timeout: it sleeps in a shared futex on the expert's slot_of
    word (read from /proc, expecting the value it saw), and finish_fill or abort_fill wakes it, which ends its
    wait at once. Asked to wait for an absent record too, it sleeps through begin_fill (woken, it sleeps again
    on "coming") until the record is published."""
    store = Store(shm_name)
    absent = end.startswith("absent")
    if not absent:
        store.slots.begin_fill(2, incoming=5)
    args = [store.index.name, str(store.SLOT_OF), str(store.meta), "5", str(int(absent))]
    with subprocess.Popen([sys.executable, "-P", "-c", WAITER, *args], stdout=subprocess.PIPE, text=True) as proc:
        try:
            address = int(proc.stdout.readline())
            sleeping = lambda value: lambda: sleeping_on(f"/proc/{proc.pid}", address) == value  # noqa: E731
            if absent:
                wait_for(sleeping(-1), what="the waiter asleep on an absent record")
                store.slots.begin_fill(2, incoming=5)
            wait_for(sleeping(-4), what="the waiter asleep on a record coming into slot 2")
            if end == "aborted":
                store.slots.abort_fill(2, incoming=5)
            else:
                store.data.view()[2 * store.stride:3 * store.stride] = b"\x05" * store.stride
                store.slots.finish_fill(2, 5)
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert out.split() == ["True", "-1" if end == "aborted" else "2"]


@pytest.mark.darwin
def test_on_macos_a_waiter_in_another_process_sleeps_on_the_word_and_the_publish_wakes_it(shm_name):
    """macOS has no /proc to see the waiter asleep: it is asked to wait up to 600 s just before the record is
    published, so it is either woken by the publish or finds it published; a wake that never comes fails the
    join. The wait sleeps with os_sync_wait_on_address (14.4+) or __ulock_wait, never the poll."""
    assert native.SlotIndex.WAIT_KIND in ("os_sync", "ulock")
    store = Store(shm_name)
    store.slots.begin_fill(2, incoming=5)
    args = [store.index.name, str(store.SLOT_OF), str(store.meta), "5", "0"]
    with subprocess.Popen([sys.executable, "-P", "-c", WAITER, *args], stdout=subprocess.PIPE, text=True) as proc:
        try:
            proc.stdout.readline()  # its address: it is about to wait
            store.slots.finish_fill(2, 5)
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert out.split()[1] == "2"


def test_slot_index_bounds_are_checked(shm_name):
    store = Store(shm_name)
    for op, match in ((lambda: store.slots.begin_fill(4), r"begin_fill\] slot = 4 is outside \[0, 4\)"),
                      (lambda: store.slots.begin_fill(0, 8), r"begin_fill\] evicted = 8 is outside \[0, 8\)"),
                      (lambda: store.slots.finish_fill(-1, 0), r"finish_fill\] slot = -1 is outside"),
                      (lambda: store.slots.finish_fill(0, 9), r"finish_fill\] expert = 9 is outside"),
                      (lambda: store.slots.abort_fill(7), r"abort_fill\] slot = 7 is outside"),
                      (lambda: store.slots.lend([0, 8]), r"lend\] experts\[1\] = 8 is outside \[0, 8\)"),
                      (lambda: store.slots.check([4], [0]), r"check\] slots\[0\] = 4 is outside \[0, 4\)"),
                      (lambda: store.slots.check([0], []), r"check\] slots and seqs differ in length"),
                      (lambda: store.slots.slot_of(-1), r"slot_of\] expert = -1 is outside"),
                      (lambda: store.slots.meta(4), r"meta\] slot = 4 is outside")):
        with pytest.raises(ValueError, match=r"\[SlotIndex\." + match):
            op()
    for layout, match in ((dict(n_experts=10_000), r"bytes .* are outside segment"),
                          (dict(n_slots=store.n_slots + 1), r"bytes .* are outside segment"),
                          (dict(slot_of_offset=store.SLOT_OF + 2), r"slot_of_offset and meta_offset must be 4-byte aligned"),
                          (dict(slot_stride=-1), r"slot_stride must be >= 0")):
        with pytest.raises(ValueError, match=r"\[SlotIndex\] " + match):
            store.slot_index(store.index, **layout)
    reader = store.slot_index(native.Segment.open(store.index.name))
    with pytest.raises(ValueError, match=r"\[SlotIndex.begin_fill\] segment .* is read-only"):
        reader.begin_fill(0)
    unserved = native.SlotIndex(store.index, None, slot_of_offset=store.SLOT_OF, meta_offset=store.meta,
                                n_experts=store.n_experts, n_slots=store.n_slots, slot_stride=store.stride)
    with pytest.raises(ValueError, match=r"\[SlotIndex.copy\] this layer has no data segment"):
        unserved.copy([], [0], [0])
    store.index.close()
    with pytest.raises(ValueError, match=r"\[SlotIndex.lend\] segment .* is closed"):
        store.slots.lend([0])


def test_copy_copies_exact_bytes(shm_name):
    store = Store(shm_name)
    records = {e: os.urandom(store.stride) for e in (1, 5, 6)}
    for slot, e in enumerate(records):
        store.fill(slot, e, records[e])
    # Two pieces of the record into two pool buffers of 4 rows each.
    pieces_spec = [(0, 1000), (1024, 3000)]
    pools = [native.Buffer(4 * n) for _, n in pieces_spec]
    pieces = [(off, n, pool, n) for (off, n), pool in zip(pieces_spec, pools)]
    experts, rows = [6, 1, 5], [3, 0, 1]
    assert store.copy(pieces, experts, rows) == [True, True, True]
    for e, row in zip(experts, rows):
        for (off, n), pool in zip(pieces_spec, pools):
            assert bytes(pool.view()[row * n : (row + 1) * n]) == records[e][off : off + n]
    assert bytes(pools[0].view()[2000:3000]) == bytes(1000)  # row 2 untouched
    # A read-only mapping of the index, as clients have, works the same.
    reader = native.Segment.open(store.index.name)
    assert store.copy(pieces, [5], [2], index=reader) == [True]
    # Pool arrays see the copied bytes.
    arr = pools[0].array(0, [4, 1000], mx.uint8)
    assert bytes(memoryview(arr[2])) == records[5][:1000]


def test_copy_into_rows_laid_out_as_slots(shm_name):
    """L0's rows hold whole records a stride apart (client/layerpool.py): one piece, the whole record, lands in
    each row at row * stride, and strided arrays over the rows see each piece of it."""
    store = Store(shm_name)
    records = {e: os.urandom(store.stride) for e in (2, 7)}
    for slot, e in enumerate(records):
        store.fill(slot, e, records[e])
    nbytes, stride = store.stride - 512, store.stride + 4096  # a record shorter than the slot, rows further apart
    rows = native.Buffer(3 * stride)
    assert store.copy([(0, nbytes, rows, stride)], [7, 2], [2, 0]) == [True, True]
    view = rows.view()
    assert bytes(view[2 * stride:2 * stride + nbytes]) == records[7][:nbytes]
    assert bytes(view[:nbytes]) == records[2][:nbytes]
    assert bytes(view[stride:2 * stride]) == bytes(stride)  # row 1 untouched
    assert bytes(view[nbytes:stride]) == bytes(stride - nbytes)  # and what lies past a record's bytes
    piece = rows.array(1024, [3, 4, 100], mx.uint8, strides=[stride, 100, 1])  # a piece at offset 1024 of a record
    for e, row in ((7, 2), (2, 0)):
        assert bytes(memoryview(piece[row])) == records[e][1024:1424]


def test_copy_on_threads_copies_exact_bytes(shm_name):
    """Records of several MiB go in 1 MiB chunks over threads: every byte lands in its row, an absent expert
    is reported as such."""
    stride = 5 << 20
    store = Store(shm_name, n_experts=4, n_slots=3, stride=stride)
    records = {e: os.urandom(stride) for e in (0, 2, 3)}
    for slot, e in enumerate(records):
        store.fill(slot, e, records[e])
    pieces_spec = [(0, (3 << 20) + 17), ((3 << 20) + 4096, (2 << 20) - 8192)]  # uneven last chunks
    pools = [native.Buffer(4 * n) for _, n in pieces_spec]
    pieces = [(off, n, pool, n) for (off, n), pool in zip(pieces_spec, pools)]
    experts, rows = [3, 1, 0, 2], [0, 1, 2, 3]
    assert store.copy(pieces, experts, rows, threads=4) == [True, False, True, True]
    for e, row in zip(experts, rows):
        for (off, n), pool in zip(pieces_spec, pools):
            got = bytes(pool.view()[row * n : (row + 1) * n])
            assert got == (records[e][off : off + n] if e in records else bytes(n))


def test_copy_refuses_absent_busy_and_foreign_slots(shm_name):
    store = Store(shm_name)
    for e, slot in ((0, 0), (1, 1), (2, 2)):
        store.fill(slot, e, bytes([e + 1]) * 64)
    pool = native.Buffer(64 * 8)
    pieces = [(0, 64, pool, 64)]
    assert store.copy(pieces, [3], [0]) == [False]  # slot_of is -1
    store.slots.begin_fill(1)  # a fill in progress: odd seq
    slot_of = store.SLOT_OF
    store.index.store_i32(slot_of + 4 * 4, 2)  # expert 4 -> slot 2, which holds expert 2
    store.index.store_i32(slot_of + 4 * 5, store.n_slots)  # a slot that does not exist
    assert store.copy(pieces, [0, 1, 4, 5, 2], [0, 1, 2, 3, 4]) == [True, False, False, False, True]
    assert bytes(pool.view()[:64]) == b"\x01" * 64
    assert bytes(pool.view()[4 * 64 : 5 * 64]) == b"\x03" * 64
    store.slots.finish_fill(1, 1)
    assert store.copy(pieces, [1], [1]) == [True]
    assert store.copy(pieces, [], []) == []


def test_copy_bounds_are_checked(shm_name):
    store = Store(shm_name)
    pool = native.Buffer(64 * 4)
    good = [(0, 64, pool, 64)]

    def bad(match, pieces=good, experts=(0,), rows=(0,), threads=1):
        with pytest.raises(ValueError, match=r"\[SlotIndex.copy\] " + match):
            store.slots.copy(pieces, list(experts), list(rows), threads)

    bad(r"experts\[0\] = 8 is outside \[0, 8\)", experts=[8])
    bad(r"experts\[1\] = -1", experts=[0, -1], rows=[0, 1])
    bad(r"rows\[0\] must be >= 0", rows=[-1])
    bad(r"bytes \[256, 320\) are outside buffer", rows=[4])
    bad(r"experts and rows differ in length", experts=[0, 1])
    bad(r"threads must be >= 1, got 0", threads=0)
    stride = store.stride  # two pages: 8 KiB with 4 KiB pages, 32 KiB on Apple Silicon's 16 KiB pages
    bad(rf"pieces\[0\] \[{stride - 192}, {stride + 8}\) overruns the {stride}-byte slot",
        pieces=[(stride - 192, 200, pool, 200)])
    bad(r"pieces\[0\]: rows 32 bytes apart cannot hold 64 bytes each", pieces=[(0, 64, pool, 32)])
    bad(r"bytes \[288, 352\) are outside buffer", pieces=[(0, 64, pool, 96)], rows=[3])
    ro = native.Segment.open(store.data.name)
    bad(r"segment .* is read-only", pieces=[(0, 64, ro, 64)])


# Another process (like the daemon) refills one slot with expert 1 until told to stop, through SlotIndex as the
# daemon does: each version fills the record with one byte value, then it pauses so that readers also find the
# slot at rest.
WRITER = """
import sys, time
from moe_l2 import _native as native
index = native.Segment.open(sys.argv[1], readonly=False)
data = native.Segment.open(sys.argv[2], readonly=False)
slot_of_offset, meta_offset, size = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
slots = native.SlotIndex(index, data, slot_of_offset=slot_of_offset, meta_offset=meta_offset, n_experts=2,
                         n_slots=1, slot_stride=size)
view = data.view()
version = 0
while index.load_u32(0) == 0:
    version += 1
    slots.begin_fill(0)
    view[:size] = bytes([version & 0xFF]) * size
    slots.finish_fill(0, 1)
    time.sleep(0.0001)
"""


def lent_read(store, pools, half):
    """The zero-copy path on the store's one slot: lend expert 1, read its bytes in place (into the pools' second
    rows, where copy puts them), then check the loan."""
    ((slot, seq),) = store.slots.lend([1])
    if slot < 0:
        return False
    data = store.data.view()
    for k, pool in enumerate(pools):
        pool.view()[half:] = data[k * half:(k + 1) * half]
    return store.slots.check([slot], [seq]) == [True]


@pytest.mark.parametrize("record, threads, path", [(256 << 10, 1, "copy"), (4 << 20, 4, "copy"),  # chunks on four
                                                   (256 << 10, 1, "lend")])
def test_readers_never_take_a_torn_record(shm_name, record, threads, path):
    """Every copy reported True, and every loan that passed its check, holds a single version of a record another
    process rewrites."""
    half = record // 2
    store = Store(shm_name, n_experts=2, n_slots=1, stride=record)
    store.fill(0, 1, bytes(record))
    pools = [native.Buffer(2 * half), native.Buffer(2 * half)]
    pieces = [(0, half, pools[0], half), (half, half, pools[1], half)]
    read = (lambda: store.copy(pieces, [1], [1], threads=threads)[0]) if path == "copy" else \
        (lambda: lent_read(store, pools, half))
    args = [store.index.name, store.data.name, str(store.SLOT_OF), str(store.meta), str(record)]
    consistent = rejected_torn = 0
    # -P: without it `python -c` puts the working directory first on sys.path, and in the
    # repository's root that is the moe_l2 source folder, which has no _native under a wheel.
    writer = [sys.executable, "-P", "-c", WRITER, *args]
    with subprocess.Popen(writer, stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (consistent < 100 or rejected_torn < 5):
                if proc.poll() is not None:
                    pytest.fail("the writer process died:\n" + proc.stderr.read().decode())
                ok = read()
                first, second = (bytes(pool.view()[half:]) for pool in pools)
                uniform = first == second == first[:1] * half
                if ok:
                    assert uniform, f"{path} vouched for a torn record"
                    consistent += 1
                elif not uniform:
                    rejected_torn += 1
        finally:
            store.index.store_u32(0, 1)  # stop
            proc.wait(timeout=30)
    assert proc.returncode == 0
    assert consistent >= 100
    assert rejected_torn >= 5, "no copy overlapped a write: the test proved nothing"


# --- crc32 --------------------------------------------------------------------------------


@pytest.fixture(params=["widest", "narrow"])
def crc_width(request):
    """The CPU's CRC as the reads run it (512-bit folding where the CPU has it), and with 128-bit folding only."""
    native._crc32_use_narrow(request.param == "narrow")
    yield request.param
    native._crc32_use_narrow(False)


@pytest.mark.parametrize("portable", [False, True])
def test_crc32_and_its_concatenation_are_zlibs(portable, crc_width):
    """The reads' checksums (the CPU's where it has one, else zlib's where the build found it, else the portable
    code; the portable code tested too) equal zlib.crc32, and two parts' CRCs concatenate to the whole's, at
    every length the slicing and the foldings treat apart (under 64 bytes, 64, 16-byte steps and tails after
    them, whole 64-byte blocks; 256 bytes and more for the 512-bit folding: whole 256-byte steps, then 64-byte
    blocks, 16-byte steps and a tail)."""
    rng = random.Random(7)
    for size in (0, 1, 7, 8, 9, 63, 64, 65, 79, 80, 127, 128, 143, 255, 256, 257, 271, 272, 320, 335, 511, 512,
                 527, 576, 4096, 100_003, 3 << 20):
        data = rng.randbytes(size)
        buf = native.Buffer(max(size, 1) + 16)
        buf.view()[5:5 + size] = data
        assert native.crc32(buf.view()[5:5 + size], portable=portable) == zlib.crc32(data)
        assert native.crc32(buf.view()[5 + size // 2:5 + size], crc=zlib.crc32(data[:size // 2]),
                            portable=portable) == zlib.crc32(data)
        for cut in {0, size // 3, size}:
            head, tail = data[:cut], data[cut:]
            assert native.crc32_concat(zlib.crc32(head), zlib.crc32(tail), len(tail),
                                       portable=portable) == zlib.crc32(data)


def test_crc32_takes_any_contiguous_bytes_like_object():
    rng = random.Random(8)
    data = rng.randbytes(100_003)
    buf = native.Buffer(len(data))
    buf.view()[:] = data
    assert native.crc32(data) == native.crc32(memoryview(buf)) == zlib.crc32(data)
    assert native.crc32(memoryview(buf)[7:], 99) == zlib.crc32(data[7:], 99)
    assert native.crc32(bytearray(data[:70])) == zlib.crc32(data[:70]) and native.crc32(b"", 5) == 5
    with pytest.raises(ValueError, match=r"^\[crc32\] takes a contiguous bytes-like object"):
        native.crc32(memoryview(data)[::2])


ARM_CRC_HARNESS = r"""
#include <cstdio>
#include <vector>
#include "crc32.h"
// argv[1]: a file of bytes; stdin: offset, length and CRC to start from, three numbers a line; stdout: the kind of
// CRC, then crc32_update of each range.
int main(int argc, char** argv) {
  std::FILE* f = std::fopen(argv[1], "rb");
  std::vector<std::byte> data(size_t(1) << 22);
  data.resize(std::fread(data.data(), 1, data.size(), f));
  std::printf("%s\n", moe_l2::crc32_kind());
  size_t offset, n;
  unsigned crc;
  while (std::scanf("%zu %zu %u", &offset, &n, &crc) == 3) {
    std::printf("%u\n", moe_l2::crc32_update(crc, data.data() + offset, n));
  }
}
"""


@pytest.mark.skipif(platform.machine() in ("arm64", "aarch64"), reason="the other tests run it here")
@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs an arm64 cross compiler and qemu-user (apt-get install g++-aarch64-linux-gnu "
                           "qemu-user), as .ci/run installs them")
@pytest.mark.parametrize("march", ["armv8-a+crc", "armv8-a"], ids=["built-with-crc", "asks-the-kernel"])
def test_crc32_on_arm64_is_zlibs_under_qemu(tmp_path, march):
    """The CRC32 instructions' code (native/crc32.cpp, three chains joined), built for arm64 as Macs build it
    (the instructions on) and as a Linux build for plain armv8-a does (the kernel asked whether the CPU has them),
    run under qemu: it runs on the instructions, with zlib.crc32's value at every length its rounds and tails
    treat apart, from any CRC."""
    native_dir = Path(__file__).resolve().parents[1] / "native"
    (tmp_path / "main.cpp").write_text(ARM_CRC_HARNESS)
    binary = tmp_path / "crc_arm"
    subprocess.run(["aarch64-linux-gnu-g++", "-O2", "-std=c++20", f"-march={march}", "-static", f"-I{native_dir}",
                    str(tmp_path / "main.cpp"), str(native_dir / "crc32.cpp"), "-o", str(binary)], check=True)
    rng = random.Random(9)
    data = rng.randbytes(4 << 20)
    (tmp_path / "data.bin").write_bytes(data)
    block = 16 << 10  # kArmBlock: a round is three of them
    lengths = [0, 1, 7, 8, 9, 63, 64, 4095, 3 * block - 1, 3 * block, 3 * block + 1, 3 * block + 8, 6 * block + 13,
               2621440, (4 << 20) - 3]
    cases = [(offset, n, rng.choice([0, 123, 0xFFFFFFFF])) for n in lengths for offset in (0, 3)
             if offset + n <= len(data)]
    run = subprocess.run(["qemu-aarch64", str(binary), str(tmp_path / "data.bin")], check=True, capture_output=True,
                         text=True, input="\n".join(f"{o} {n} {c}" for o, n, c in cases))
    kind, *values = run.stdout.split()
    assert kind == "arm-crc32"
    assert [int(v) for v in values] == [zlib.crc32(data[o:o + n], c) for o, n, c in cases]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="carry-less multiplication is x86-64's")
def test_crc32_runs_on_carry_less_multiplication_on_x86_64():
    # Every x86-64 CPU since 2010 has PCLMULQDQ: the reads must not fall back to zlib's slower code there; one
    # with VPCLMULQDQ and AVX-512 folds 512 bits at a time (4x as fast here).
    if not sys.platform.startswith("linux"):
        assert native.CRC32_KIND in ("pclmul", "vpclmulqdq")
        return
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert native.CRC32_KIND == ("vpclmulqdq" if {"vpclmulqdq", "avx512f"} <= flags else "pclmul")


# --- pread_records ----------------------------------------------------------------------


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "model.bin"
    payload = os.urandom(20 << 20)  # more than two 8 MiB read units
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    yield fd, payload, path
    os.close(fd)


def test_pread_records_reads_exact_bytes(data_file):
    fd, payload, _ = data_file
    dst = native.Buffer(len(payload) + PAGE)
    native.pread_records([(fd, 0, len(payload), dst, PAGE)], threads=1)
    assert bytes(dst.view()[PAGE:]) == payload
    assert bytes(dst.view()[:PAGE]) == bytes(PAGE)


def test_pread_records_many_jobs_on_many_threads(data_file, shm_name):
    fd, payload, _ = data_file
    dst = native.Buffer(len(payload))
    seg = native.Segment.create(shm_name(), 1 << 20)
    # Scattered records, in reverse order, into a buffer and a shared-memory segment.
    jobs = [(fd, off, 65_536 + 7, dst, off) for off in range(len(payload) - (1 << 17), 0, -(1 << 17))]
    jobs += [(fd, 12_345, 1 << 19, seg, 4096), (fd, 0, 0, dst, 0)]
    native.pread_records(jobs, threads=4)
    for _, off, n, mem, dst_off in jobs:
        assert bytes(mem.view()[dst_off : dst_off + n]) == payload[off : off + n]
    native.pread_records([], threads=8)


def pending_bytes(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except BlockingIOError:
        return b""


def test_pread_scatter_says_each_job_has_landed_as_it_lands(data_file):
    """Job j's word landed_at[j] becomes 1 once its bytes are all in place, before the jobs after it are read
    (the donor copies that record meanwhile: client/donor.py), and landed_fd gets a byte for each job but the last
    to land, which the call returns with. The wake-up pipe is full and blocking here, so the one read thread stops
    at job 0's wake-up until the test drains it."""
    fd, payload, _ = data_file
    mib = 1 << 20
    dst = native.Buffer(3 * mib)
    words = native.Buffer(16)
    words.store_u32(12, 7)  # a word no job names: the read leaves it alone
    r, w = os.pipe()
    os.set_blocking(w, False)
    filled = 0
    for chunk in (b"\0" * 4096, b"\0"):  # full to the last byte
        with contextlib.suppress(BlockingIOError):
            while True:
                filled += os.write(w, chunk)
    os.set_blocking(w, True)
    os.set_blocking(r, False)
    jobs = [(fd, j * mib, mib, [(0, mib, dst, j * mib)]) for j in range(3)]
    read = threading.Thread(target=native.pread_scatter, args=(jobs,),
                            kwargs=dict(threads=1, landed=words, landed_at=[2, 0, 1], landed_fd=w))
    read.start()
    drained = 0
    try:
        wait_for(lambda: words.load_u32(8) == 1, what="job 0's word (2)")
        assert [words.load_u32(4 * i) for i in (0, 1, 3)] == [0, 0, 7]  # jobs 1 and 2 not read yet
    finally:
        while chunk := pending_bytes(r):
            drained += len(chunk)
        read.join()
    while chunk := pending_bytes(r):
        drained += len(chunk)
    assert [words.load_u32(4 * i) for i in range(4)] == [1, 1, 1, 7]
    assert bytes(dst.view()) == payload[:3 * mib]
    assert drained - filled == 2  # jobs 0 and 1
    os.close(r)
    os.close(w)


def test_pread_scatter_refuses_landed_words_it_cannot_set(data_file):
    fd, _, _ = data_file
    dst, words = native.Buffer(PAGE), native.Buffer(8)
    jobs = [(fd, 0, PAGE, [(0, PAGE, dst, 0)])]
    for kwargs, message in ((dict(landed_at=[0]), "landed needs landed_fd"),
                            (dict(landed_at=[0, 1], landed_fd=1), "a word for each of the 1 jobs; got 2"),
                            (dict(landed_at=[2], landed_fd=1), r"bytes \[8, 12\) are outside"),
                            (dict(landed_at=[-1], landed_fd=1), "landed_at must be >= 0")):
        with pytest.raises(ValueError, match=message):
            native.pread_scatter(jobs, landed=words, **kwargs)


def test_wakes_asked_for_are_written_by_this_threads_next_read_by_a_flush_and_by_wake(data_file):
    fd, payload, _ = data_file
    dst = native.Buffer(1 << 20)
    pipes = [os.pipe() for _ in range(2)]
    for r, _ in pipes:
        os.set_blocking(r, False)
    try:
        native.wake_when_reading([w for _, w in pipes])
        assert [pending_bytes(r) for r, _ in pipes] == [b"", b""]  # nothing until a read runs
        # Another thread's read does not write this thread's wakes.
        other = threading.Thread(target=native.pread_records, args=([(fd, 0, 4096, dst, 0)],))
        other.start()
        other.join()
        assert [pending_bytes(r) for r, _ in pipes] == [b"", b""]
        native.pread_scatter([(fd, 0, 1 << 20, [(0, 1 << 20, dst, 0)])], threads=2)
        assert [pending_bytes(r) for r, _ in pipes] == [b"\0", b"\0"]  # once each, as the read ran
        native.pread_records([(fd, 0, 4096, dst, 0)], threads=1)
        native.flush_read_wakes()
        assert [pending_bytes(r) for r, _ in pipes] == [b"", b""]  # written once: nothing left
        native.wake_when_reading([pipes[0][1]])
        native.flush_read_wakes()  # a fetch that read nothing
        assert [pending_bytes(r) for r, _ in pipes] == [b"\0", b""]
        native.wake(pipes[1][1])  # one byte now, whatever is set
        assert [pending_bytes(r) for r, _ in pipes] == [b"", b"\0"]
        os.set_blocking(pipes[1][1], False)
        with pytest.raises(BlockingIOError):
            while True:
                os.write(pipes[1][1], bytes(4096))
        native.wake(pipes[1][1])  # a full pipe holds wake-ups already: nothing raised
        assert bytes(dst.view()[:4096]) == payload[:4096]
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_pread_records_short_file_is_a_clear_error(data_file):
    fd, payload, path = data_file
    dst = native.Buffer(1 << 20)
    with pytest.raises(OSError) as info:
        native.pread_records([(fd, 0, 4096, dst, 0), (fd, len(payload) - 100, 4096, dst, 8192)])
    message = str(info.value)
    assert message.startswith("[pread_records] unexpected end of file in job 1")
    assert "truncated model file" in message
    assert str(path) in message or sys.platform not in ("linux", "darwin")


def test_pread_records_reports_errno(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_WRONLY)  # readable by nobody: pread fails with EBADF
    try:
        with pytest.raises(OSError, match=r"^\[pread_records\] reading job 0: .* failed") as info:
            native.pread_records([(fd, 0, 10, native.Buffer(64), 0)])
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_pread_records_checks_its_destinations(data_file, shm_name):
    fd, _, _ = data_file
    name = shm_name()
    native.Segment.create(name, PAGE)
    ro = native.Segment.open(name)
    with pytest.raises(ValueError, match=r"\[pread_records\] segment '.*' is read-only"):
        native.pread_records([(fd, 0, 16, ro, 0)])
    with pytest.raises(ValueError, match=r"\[pread_records\] bytes \[4090, 4106\) are outside"):
        native.pread_records([(fd, 0, 16, native.Buffer(4096), 4090)])
    with pytest.raises(ValueError, match=r"\[pread_records\] jobs\[0\]: invalid file descriptor"):
        native.pread_records([(-1, 0, 16, native.Buffer(64), 0)])
    with pytest.raises(ValueError, match=r"\[pread_records\] threads must be >= 1"):
        native.pread_records([(fd, 0, 16, native.Buffer(64), 0)], threads=0)


def test_the_extension_ships_type_stubs_naming_all_it_exports_with_their_signatures():
    import ast
    from pathlib import Path

    stub = Path(native.__file__).with_name("_native.pyi")
    tree = ast.parse(stub.read_text())
    stubbed = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    constants = {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
    assert set(stubbed) | constants == {name for name in dir(native) if not name.startswith("_")}
    methods = {node.name: ast.unparse(node.args) + " -> " + ast.unparse(node.returns)
               for node in stubbed["Segment"].body if isinstance(node, ast.FunctionDef)}
    assert methods["create"] == f"name: str, nbytes: int, mode: int={0o600} -> Segment"
    assert methods["array"] == ("self, offset: int, shape: Sequence[int], strides: Sequence[int], "
                                "dtype: mlx.core.Dtype -> mlx.core.array")
    import moe_l2

    assert (Path(moe_l2.__file__).parent / "py.typed").exists()  # type checkers read moe_l2's own annotations


@pytest.mark.parametrize("src_offset,dst_offset,size", [(0, 0, (3 << 20) + 12345), (3, 4096 + 5, 64 * 3 + 7),
                                                       (17, 1, 100_003), (1, 15, 15), (0, 9, 64)])
def test_copy_record_with_no_pieces_lands_every_byte_of_the_range_and_none_outside_it(src_offset, dst_offset, size):
    """The copy with no checksum (a manifest checks the slot: client/donor.py) bypasses the cache on x86-64: its
    unaligned head, its 64-byte body and its tail all land, whatever the offsets."""
    src, dst = native.Buffer(size + 64), native.Buffer(size + 8192)
    src.view()[:] = random.Random(size).randbytes(size + 64)
    dst.view()[:] = b"\xee" * dst.nbytes
    assert native.copy_record(src, src_offset, dst, dst_offset, size, []) == 0
    out = bytes(dst.view())
    assert out[dst_offset:dst_offset + size] == bytes(src.view()[src_offset:src_offset + size])
    assert out[:dst_offset] + out[dst_offset + size:] == b"\xee" * (dst.nbytes - size)


def test_copy_record_copies_the_range_and_checksums_its_pieces_as_zlib_does():
    """A donor's copy into a slot (client/donor.py): every byte of the range lands, the CRC covers the pieces only,
    in order, across the chunks the copy is made in; a read-only destination and pieces out of order are refused."""
    size = (3 << 20) + 12345  # past several 1 MiB chunks, a piece across each boundary
    src, dst = native.Buffer(size + 4096), native.Buffer(size + 8192)
    src.view()[:] = random.Random(7).randbytes(size + 4096)
    pieces = [(0, 1000), (5000, (1 << 20) + 7), ((2 << 20) - 3, 900_000), (size - 10, 10)]
    crc = native.copy_record(src, 4096, dst, 8192, size, pieces)
    data = bytes(src.view()[4096:4096 + size])
    assert bytes(dst.view()[8192:8192 + size]) == data
    want = 0
    for off, n in pieces:
        want = zlib.crc32(data[off:off + n], want)
    assert crc == want
    assert native.copy_record(src, 0, dst, 0, 100, []) == 0  # no pieces: a plain copy
    with pytest.raises(ValueError, match="not after the one before it"):
        native.copy_record(src, 0, dst, 0, size, [(5000, 10), (0, 10)])
    name = f"/ml2copy{os.getpid()}"
    segment = native.Segment.create(name, 1 << 16)
    try:
        readonly = native.Segment.open(name, readonly=True)
        with pytest.raises(ValueError):
            native.copy_record(src, 0, readonly, 0, 4096, [])
        readonly.close()
    finally:
        segment.close()
        native.Segment.unlink(name)
