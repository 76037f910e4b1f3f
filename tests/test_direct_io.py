"""Direct I/O for L3 reads: exact bytes whatever the alignment, a buffered fallback when the filesystem refuses,
and the point of it all: reads that leave the page cache alone (checked with mincore)."""

from __future__ import annotations

import errno
import os
import sys

import pytest

from moe_l2 import _native
from moe_l2.client.pool import ExpertPool
from moe_l2.lab.random_models import make_model
from moe_l2.model import ModelFiles
from moe_l2.model.packer import pack
from moe_l2.model.records import record_checksum

from .conftest import budget_for, stats, wait_for

linux = pytest.mark.skipif(sys.platform != "linux", reason="O_DIRECT and posix_fadvise are Linux's")
MIB = 1 << 20


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.bin"
    payload = os.urandom(20 * MIB + 1234)  # more than two 8 MiB read units, not a whole block
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped from the page cache
    os.close(fd)
    fds = []

    def open_(direct: bool) -> int:
        fds.append(os.open(path, os.O_RDONLY))
        if direct:
            _native.set_direct(fds[-1], True)
        return fds[-1]

    yield path, payload, open_
    for fd in fds:
        os.close(fd)


def _is_direct(fd: int) -> bool:
    return ModelFiles.direct_fds([fd])


@linux
def test_set_direct_turns_o_direct_on_and_off(data):
    _, _, open_ = data
    fd = open_(False)
    assert not _is_direct(fd)
    assert _native.set_direct(fd, True) is True and _is_direct(fd)
    assert _native.set_direct(fd, False) is False and not _is_direct(fd)
    with pytest.raises(ValueError, match=r"^\[set_direct\] invalid file descriptor -1"):
        _native.set_direct(-1)


@linux
def test_a_filesystem_without_direct_io_keeps_the_fd_buffered():
    fd = os.open("/proc/self/stat", os.O_RDONLY)  # procfs has no direct I/O, like ramfs or some FUSE mounts
    try:
        assert _native.set_direct(fd, True) is False
        assert not _is_direct(fd)
        buf = _native.Buffer(4096)
        _native.pread_records([(fd, 0, 10, buf, 0)])
        assert bytes(buf.view()[:10]).split()[0] == str(os.getpid()).encode()
    finally:
        os.close(fd)


CASES = [  # (file offset, nbytes, destination offset)
    (0, 4096, 0),  # aligned: straight into the destination
    (0, 16 * MIB, 4096),  # aligned, two units
    (1, 5000, 3),  # nothing aligned
    (4096 * 3 + 7, 9 * MIB + 11, 4096),  # unaligned across units
    (8 * MIB - 100, 200, 64),  # across a unit boundary of the file
    (20 * MIB + 1234 - 100, 100, 5),  # the file's last, partial block
    (0, 20 * MIB + 1234, 1),  # the whole file, to its partial end
]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("offset,nbytes,dst_offset", CASES)
def test_pread_records_reads_exact_bytes_at_any_alignment(data, direct, offset, nbytes, dst_offset):
    _, payload, open_ = data
    fd = open_(direct)
    dst = _native.Buffer(nbytes + dst_offset + 4096)
    _native.pread_records([(fd, offset, nbytes, dst, dst_offset)], threads=3)
    view = dst.view()
    assert bytes(view[dst_offset:dst_offset + nbytes]) == payload[offset:offset + nbytes]
    assert bytes(view[:dst_offset]) == bytes(dst_offset)  # nothing written outside the job
    assert bytes(view[dst_offset + nbytes:]) == bytes(len(view) - dst_offset - nbytes)


@pytest.mark.parametrize("direct", [False, True])
def test_pread_scatter_reads_once_and_scatters(data, direct):
    _, payload, open_ = data
    fd = open_(direct)
    a, b = _native.Buffer(2048), _native.Buffer(12 * MIB)
    jobs = [
        (fd, 123, 10 * MIB, [(0, 1000, a, 0), (5000, 9 * MIB, b, 64)]),
        (fd, 4096, 4096, [(100, 100, a, 1000)]),
        (fd, len(payload) - 10, 10, [(0, 10, a, 2000)]),
        (fd, 0, 0, []),
    ]
    _native.pread_scatter(jobs, threads=4)
    assert bytes(a.view()[:1000]) == payload[123:1123]
    assert bytes(b.view()[64:64 + 9 * MIB]) == payload[5123:5123 + 9 * MIB]
    assert bytes(a.view()[1000:1100]) == payload[4196:4296]
    assert bytes(a.view()[2000:2010]) == payload[-10:]
    _native.pread_scatter([], threads=2)


@pytest.fixture(params=[True, False], ids=["straight", "copied"])
def straight(request):
    """pread_scatter as it reads (aligned pieces straight into their rows), and with every piece copied out of
    its scratch (the bench hook that times the two apart)."""
    _native._scatter_straight(request.param)
    yield request.param
    _native._scatter_straight(True)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("unit", [4096, 256 << 10, 1 * MIB, 8 * MIB])
def test_pread_scatter_in_any_unit_scatters_exact_bytes_and_checksums_them(data, direct, unit, straight):
    """Records read in units of `unit` bytes: every piece lands whole (aligned and not, pieces that share bytes
    too), and the checksum each job returns is record_checksum of its pieces in order (zlib.crc32 chained),
    padding between them left out."""
    _, payload, open_ = data
    fd = open_(direct)
    rows = _native.Buffer(16 * MIB)
    jobs = [  # (file offset, extent bytes, [(piece offset, piece bytes)]): gaps between pieces, a piece across units
        (4096, 3 * MIB, [(0, 49152), (53248, 786432), (MIB + 5, 2 * MIB - 4096)]),
        (7, 5000, [(10, 4000)]),
        (len(payload) - 9000, 9000, [(0, 100), (200, 8800)]),
        (8 * MIB, 8192, [(0, 4096), (2048, 4096)]),  # pieces that share bytes
    ]
    scatter, at = [], 0
    for offset, nbytes, pieces in jobs:
        scatter.append((fd, offset, nbytes, [(o, n, rows, at + i * 4 * MIB // 4) for i, (o, n) in enumerate(pieces)]))
        at += 4 * MIB
    sums = _native.pread_scatter(scatter, threads=3, unit_bytes=unit, checksums=True)
    view = rows.view()
    for (offset, _, pieces), (_, _, _, targets), checksum in zip(jobs, scatter, sums):
        for (o, n), (_, _, _, dst) in zip(pieces, targets):
            assert bytes(view[dst:dst + n]) == payload[offset + o:offset + o + n]
        assert checksum == record_checksum(payload[offset + o:offset + o + n] for o, n in pieces)
    assert _native.pread_scatter(scatter, threads=2, unit_bytes=unit) == []  # none asked for


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("unit", [4096, 1 * MIB, 8 * MIB])
def test_pread_scatter_into_rows_laid_out_as_the_file(data, direct, unit, straight):
    """Pieces that lie in one buffer as they lie in the file (an L0 row: client/layerpool.py) are read as one range,
    pieces of unaligned sizes and the padding between them included: every piece lands whole, the checksum leaves
    the padding out, and nothing of the buffer before the first piece or after the last is written. A piece
    elsewhere splits the run."""
    _, payload, open_ = data
    fd = open_(direct)
    row = 7 * MIB
    rows = _native.Buffer(3 * row)
    rows.view()[:] = b"\xab" * (3 * row)
    # gpt-oss-20b's pieces: unaligned sizes, 64-byte aligned offsets, padding between them
    pieces = [(0, 4147200), (4147200, 259200), (4406400, 5760), (4412160, 4147200 // 2)]
    extent = 4412160 + 4147200 // 2 + 7
    other = _native.Buffer(MIB)
    jobs = [
        (fd, 4096, extent, [(o, n, rows, o) for o, n in pieces]),  # a record at an aligned place, into row 0
        (fd, 3 * MIB + 64, extent, [(o, n, rows, row + 4096 + o) for o, n in pieces]),  # unaligned in file and row
        (fd, 8 * MIB, extent, [(o, n, rows, 2 * row + o) for o, n in pieces[:2]]  # a piece elsewhere between two
         + [(pieces[2][0], pieces[2][1], other, 100)] + [(pieces[3][0], pieces[3][1], rows, 2 * row + pieces[3][0])]),
    ]
    sums = _native.pread_scatter(jobs, threads=3, unit_bytes=unit, checksums=True)
    view = rows.view()
    for (_, offset, _, targets), checksum in zip(jobs, sums):
        for o, n, dst, at in targets:
            assert bytes(dst.view()[at:at + n]) == payload[offset + o:offset + o + n]
        assert checksum == record_checksum(payload[offset + o:offset + o + n] for o, n, _, _ in targets)
    last = pieces[-1][0] + pieces[-1][1]
    assert bytes(view[last:row]) == b"\xab" * (row - last)
    assert bytes(view[row:row + 4096]) == b"\xab" * 4096
    assert bytes(view[row + 4096 + last:2 * row]) == b"\xab" * (row - 4096 - last)
    assert bytes(view[2 * row + last:]) == b"\xab" * (row - last)


def test_read_units_are_checked():
    for unit in (0, 100, 4097, 2 << 30):
        with pytest.raises(ValueError, match=r"^\[pread_scatter\] unit_bytes must be a multiple of 4096 from 4096 "
                                             rf"to 1 GiB, got {unit}$"):
            _native.pread_scatter([], unit_bytes=unit)
        with pytest.raises(ValueError, match=r"^\[pread_records\] unit_bytes must be a multiple of 4096"):
            _native.pread_records([], unit_bytes=unit)


def test_pread_scatter_checks_its_jobs(data, tmp_path):
    _, payload, open_ = data
    fd = open_(False)
    buf = _native.Buffer(4096)
    with pytest.raises(ValueError, match=r"^\[pread_scatter\] jobs\[0\] piece 0: bytes \[100, 200\) are outside "
                                         r"the job's 150 bytes"):
        _native.pread_scatter([(fd, 0, 150, [(100, 100, buf, 0)])])
    with pytest.raises(ValueError, match=r"^\[pread_scatter\] bytes \[4000, 4200\) are outside buffer"):
        _native.pread_scatter([(fd, 0, 200, [(0, 200, buf, 4000)])])
    with pytest.raises(ValueError, match=r"^\[pread_scatter\] jobs\[0\]: invalid file descriptor"):
        _native.pread_scatter([(-1, 0, 1, [])])
    with pytest.raises(OSError, match=r"^\[pread_scatter\] unexpected end of file in job 0: .*truncated model file"):
        _native.pread_scatter([(fd, len(payload) - 10, 100, [(0, 100, buf, 0)])])
    wfd = os.open(tmp_path / "data.bin", os.O_WRONLY)
    try:
        with pytest.raises(OSError, match=r"^\[pread_scatter\] reading job 0: .* failed") as info:
            _native.pread_scatter([(wfd, 0, 10, [(0, 10, buf, 0)])])
        assert info.value.errno == errno.EBADF
    finally:
        os.close(wfd)


@linux
def test_direct_reads_past_the_end_are_a_clear_error(data):
    _, payload, open_ = data
    fd = open_(True)
    with pytest.raises(OSError, match=r"^\[pread_records\] unexpected end of file in job 0: bytes \[20972754, "
                                      r"20972854\) .*it has 20972754 bytes"):
        _native.pread_records([(fd, len(payload) - 100, 200, _native.Buffer(4096), 0)])


@linux
def test_a_refused_direct_read_falls_back_to_buffered(data):
    _, payload, open_ = data
    fd = open_(True)
    before = _native.direct_fallbacks()
    _native._fail_direct_reads(1)  # as on a filesystem whose direct reads fail with EINVAL
    try:
        dst = _native.Buffer(MIB)
        _native.pread_records([(fd, 4096, MIB, dst, 0)], threads=2)
    finally:
        _native._fail_direct_reads(0)
    assert bytes(dst.view()) == payload[4096:4096 + MIB]
    assert _native.direct_fallbacks() == before + 1
    assert not _is_direct(fd)  # buffered from now on


@linux
def test_a_refused_direct_read_into_the_rows_falls_back_and_lands_whole(data):
    """pread_scatter reads aligned pieces straight into their rows and the rest through its scratch, in one
    preadv a unit; refused mid-call, the same reads go buffered and every piece still lands exact."""
    _, payload, open_ = data
    fd = open_(True)
    rows = _native.Buffer(4 * MIB)
    # A record at a block: an aligned piece, an unaligned one, an aligned one after the padding, a tail piece.
    pieces = [(0, 65536, rows, 0), (65536, 1000, rows, MIB + 3), (69632, 8192, rows, 131072),
              (77824, 77, rows, 2 * MIB)]
    before = _native.direct_fallbacks()
    _native._fail_direct_reads(2)
    try:
        sums = _native.pread_scatter([(fd, 8192, 77901, pieces), (fd, 3 * MIB, 4096, [(0, 4096, rows, 3 * MIB)])],
                                     threads=2, unit_bytes=4096 * 4, checksums=True)
    finally:
        _native._fail_direct_reads(0)
    view = rows.view()
    for src, n, _, dst in pieces:
        assert bytes(view[dst:dst + n]) == payload[8192 + src:8192 + src + n]
    assert bytes(view[3 * MIB:3 * MIB + 4096]) == payload[3 * MIB:3 * MIB + 4096]
    assert sums[0] == record_checksum(payload[8192 + src:8192 + src + n] for src, n, _, _ in pieces)
    assert bytes(view[65536:131072]) == bytes(65536)  # nothing written between the pieces' rows
    assert _native.direct_fallbacks() == before + 1 and not _is_direct(fd)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    src = make_model(root / "src", arch="mixtral", layers=2, experts=8, top_k=2, hidden_size=128,
                     moe_hidden_size=128, bits=8, seed=6)
    return ModelFiles.open(src), pack(src, root / "packed", progress=False)


@linux
def test_open_fds_defaults_to_direct_for_packed_models_only(models):
    stacked, packed = models
    assert packed.direct_default and not stacked.direct_default
    for files, direct, want in [(packed, None, True), (packed, False, False), (stacked, None, False),
                                (stacked, True, True)]:
        fds = files.open_fds(direct)
        try:
            assert len(fds) == len(files.files)
            assert ModelFiles.direct_fds(fds) == want
        finally:
            for fd in fds:
                os.close(fd)


def _drop(files: ModelFiles) -> None:
    for path in files.files:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _cached(files: ModelFiles) -> int:
    total = 0
    for path in files.files:
        fd = os.open(path, os.O_RDONLY)
        total += _native.page_cache_bytes(fd)
        os.close(fd)
    return total


@linux
@pytest.mark.parametrize("which", ["stacked", "packed"])
def test_direct_pool_reads_are_exact_and_leave_the_page_cache_alone(models, which):
    files = dict(zip(("stacked", "packed"), models))[which]
    expert_bytes = files.n_layers * files.n_experts * files.layout.nbytes
    for direct in (True, False):
        _drop(files)
        assert _cached(files) == 0
        pool = ExpertPool(files, capacity=files.n_experts, direct=direct)
        try:
            for layer in range(files.n_layers):
                pool.fetch(layer, list(range(files.n_experts)))
                for e in range(files.n_experts):
                    assert pool.layers[layer].record(e) == files.read_record(layer, e)
                    pool.evict(layer, e)
            _drop(files)  # read_record reads through the page cache: measure a fresh pass
            for layer in range(files.n_layers):
                pool.fetch(layer, list(range(files.n_experts)))
        finally:
            pool.close()
        cached = _cached(files)
        if direct:
            assert cached == 0, cached
        else:
            assert cached >= expert_bytes // 2, (cached, expert_bytes)


def test_page_cache_bytes_counts_resident_pages(data):
    path, payload, open_ = data
    fd = open_(False)
    assert _native.page_cache_bytes(fd, 0, 0) == 0
    assert _native.page_cache_bytes(fd, len(payload) + 10) == 0
    os.read(fd, 3 * MIB)
    assert _native.page_cache_bytes(fd) >= 3 * MIB
    assert _native.page_cache_bytes(fd, 4096, 100) == 100
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert _native.page_cache_bytes(fd) == 0
    with pytest.raises(ValueError, match=r"^\[page_cache_bytes\] invalid file descriptor"):
        _native.page_cache_bytes(-1)


@linux
def test_the_daemon_loads_a_packed_model_with_direct_reads(models, daemon_factory):
    _, packed = models
    daemon = daemon_factory([packed.path], str(budget_for(packed, packed.n_experts)))
    _drop(packed)  # the daemon read the headers at start
    from moe_l2 import protocol
    from moe_l2.client.connection import L2Client, request

    for layer in range(packed.n_layers):
        request(daemon.socket, protocol.Prefetch(id=1, model=packed.fingerprint, layer=layer,
                                                 experts=list(range(packed.n_experts))))
    wait_for(lambda: stats(daemon)["models"][0]["loads_done"] == packed.n_layers * packed.n_experts, what="loads")
    assert _cached(packed) == 0  # no record went through the page cache
    client = L2Client(packed, daemon.socket, wait_s=5)
    pool = ExpertPool(packed, capacity=packed.n_experts, client=client)
    try:
        for layer in range(packed.n_layers):
            assert pool.fetch(layer, list(range(packed.n_experts))).l2_hits == packed.n_experts
            for e in range(packed.n_experts):
                assert pool.layers[layer].record(e) == packed.read_record(layer, e)
    finally:
        pool.close()
        client.close()


@linux
@pytest.mark.parametrize("flag, packed_direct, stacked_direct", [("auto", True, False), ("on", True, True),
                                                                 ("off", False, False)])
def test_the_daemon_direct_io_flag_chooses_per_model(models, daemon_factory, flag, packed_direct, stacked_direct):
    stacked, packed = models
    daemon = daemon_factory([stacked.path, packed.path], str(budget_for(packed, 2)), "--direct-io", flag)
    direct = {m["format"]: m["direct_io"] for m in stats(daemon)["models"]}
    assert direct == {"safetensors": stacked_direct, "packed": packed_direct}
    for layer in range(packed.n_layers):  # and the reads through those fds are exact
        from moe_l2 import protocol
        from moe_l2.client.connection import request

        request(daemon.socket, protocol.Prefetch(id=1, model=packed.fingerprint, layer=layer, experts=[0, 1]))
    wait_for(lambda: stats(daemon)["models"][1]["loads_done"] == 2 * packed.n_layers, what="loads")
    assert stats(daemon)["models"][1]["load_errors"] == 0


def test_a_bad_direct_io_value_is_refused_at_start(models, tmp_path):
    import subprocess

    stacked, _ = models
    result = subprocess.run([sys.executable, "-P", "-m", "moe_l2.daemon.main", "--model", str(stacked.path),
                             "--budget", "1G", "--direct-io", "maybe", "--runtime-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--direct-io" in result.stderr
