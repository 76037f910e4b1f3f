"""`moe-l2 doctor`: what this machine gives moe-l2 and what moe-l2 will do on it, tried for real where it can be
(a shared-memory segment made, locked and read through MLX; a model file read), as a short table to paste into
an issue or one JSON object (`--json`, every figure with its unit: _bytes, _s, _mb_s).

Exit status 1 when a check finds something that makes moe-l2 slow or unsafe here; each such check says what to
do. Never touches the network (docs/architecture.md, "moe-l2 doctor"; docs/macos.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass

from moe_l2 import __version__, machine
from moe_l2.layout import page_size
from moe_l2.model.location import socket_arg
from moe_l2.sizes import format_size, parse_size

DAEMON_TIMEOUT_S = 1.0  # a daemon that answers at all answers stats in milliseconds
MARKS = {"ok": "ok", "note": "note", "warn": "warn", "fail": "FAIL"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR|ID",
                        help="also check this model (a directory or a Hugging Face repo id in the local cache; never "
                             "downloads): direct I/O on its filesystem, a short read of one file, the plan's split")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="check this L2 budget (moe-l2d --budget) against shared memory and locking (default: "
                             "the plan's for --model)")
    parser.add_argument("--socket", default=None, type=socket_arg,
                        help="daemon address (default: the local runtime dir)")
    parser.add_argument("--timeout", type=float, default=DAEMON_TIMEOUT_S, metavar="S",
                        help=f"seconds to wait for the daemon (default {DAEMON_TIMEOUT_S:g})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class Check:
    name: str
    status: str  # ok, note (a fact worth knowing), warn (not slow or unsafe by itself), fail (slow or unsafe)
    detail: str
    fix: str | None = None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _count(n: int | None) -> str:
    return "unlimited" if n is None else str(n)


# --- the checks: each returns its facts and its checks ---------------------------------------------------------


def check_backend() -> tuple[dict, list[Check]]:
    import mlx.core as mx

    metal, cuda = mx.metal.is_available(), mx.cuda.is_available()
    backend = "metal" if metal else "cuda" if cuda else "cpu"
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    facts = {"backend": backend, "default_device": device, "metal": metal, "cuda": cuda}
    detail = f"{backend} (default device {device}; Metal {'available' if metal else 'not available'})"
    if sys.platform == "darwin" and not metal:
        return facts, [Check("MLX backend", "fail", detail + ": on a Mac MLX computes on the CPU only, many times "
                             "slower", "use an arm64 Python, not one under Rosetta (python -c 'import platform; "
                             "print(platform.machine())' must say arm64), and pip install mlx there")]
    return facts, [Check("MLX backend", "ok", detail)]


def check_zero_copy(probe: machine.SegmentProbe | OSError) -> tuple[dict, list[Check]]:
    """An MLX array over a real segment (Segment.array, as client/l2view.py makes them) must see writes made
    through the segment after it was made: then a layer computes on L2's records in place."""
    import mlx.core as mx

    from moe_l2.client.l2view import L2View

    if isinstance(probe, OSError):
        return ({"possible": False, "client_uses": L2View.supported(), "why_not": str(probe)},
                [Check("zero-copy L2", "fail", f"no shared-memory segment could be made: {probe}",
                       "moe-l2d cannot run here either: free or enlarge shared memory, or raise ulimit -n")])
    why = None
    try:
        view, n = probe.segment.view(), 16
        array = probe.segment.array(0, [n], [1], mx.uint8)
        for value in (0x5A, 0xA5):
            view[:n] = bytes([value]) * n
            if mx.sum(array.astype(mx.uint32)).item() != n * value:
                why = "an MLX array over a segment did not see a later write through the segment: MLX copied it"
                break
        del array, view
    except Exception as exc:  # Segment.array refuses where MLX cannot compute on host memory (CUDA)
        why = str(exc)
    facts = {"possible": why is None, "client_uses": L2View.supported(), "why_not": why}
    if why is None:
        return facts, [Check("zero-copy L2", "ok", "MLX computes on shared memory in place (a write through a "
                             "segment was seen by an array over it)")]
    return facts, [Check("zero-copy L2", "fail", f"impossible here: {why}; every L2 hit would be copied",
                         "moe-l2 generate/serve still run with --l2-reads copy; send this output in an issue "
                         "(docs/macos.md)")]


def check_memory(room: machine.SharedMemoryRoom, budget: int | None, source: str | None) -> tuple[dict, list[Check]]:
    facts = {"total_bytes": room.total, "available_bytes": room.available, "inactive_bytes": room.inactive,
             "swap_total_bytes": machine.swap_total(), "budget_refused_above_bytes": room.refused_above,
             "budget_warned_above_bytes": room.warned_above}
    shm = {"path": room.shm_path, "size_bytes": room.shm_size, "free_bytes": room.shm_free}
    if room.shm_path is None:
        shm["sysv"] = machine.sysv_shm_limits()
        where = "no /dev/shm: POSIX shared memory is bounded by memory alone"
    else:
        where = f"{room.shm_path} {format_size(room.shm_size)}, {format_size(room.shm_free)} free"
    detail = (f"memory {format_size(room.total)}, available {format_size(room.available)}"
              + (f" (+{format_size(room.inactive)} inactive)" if room.inactive else "") + f"; {where}; moe-l2d "
              f"starts with budgets up to {format_size(room.refused_above)}")
    checks = [Check("memory", "note", detail)]
    if budget is not None:
        refusal, warning = room.check(budget)
        which = f"{format_size(budget)} ({source})"
        if refusal:
            checks.append(Check("budget", "fail", f"{which}: moe-l2d refuses it: {refusal[0]}", refusal[1]))
        elif warning:
            checks.append(Check("budget", "warn", f"{which}: {warning}"))
        else:
            checks.append(Check("budget", "ok", f"{which} fits in memory"
                                + (f" and {room.shm_path}" if room.shm_path else "")))
    return {"memory": facts, "shared_memory": shm}, checks


def _lock_fix() -> str:
    if sys.platform == "darwin":
        return ("run moe-l2d as the launchd daemon (systemd/README.md), which may lock what macOS' wired-memory "
                "limit allows (sysctl vm.user_wire_limit)")
    return ("run moe-l2d from the systemd unit (LimitMEMLOCK=infinity, systemd/README.md), or raise the limit "
            "(ulimit -l unlimited as root; memlock in /etc/security/limits.conf), or run it as root")


def check_locking(probe: machine.SegmentProbe | OSError, budget: int | None) -> tuple[dict, list[Check]]:
    soft, hard = machine.memlock_limits()
    lockable, leave = machine.lockable_bytes(), machine.unlocked_pages_may_leave()
    made = isinstance(probe, machine.SegmentProbe)
    facts = {"memlock_soft_bytes": soft, "memlock_hard_bytes": hard, "can_lock_any": machine.can_lock_any(),
             "lockable_bytes": lockable, "probe_locked": made and probe.locked,
             "probe_error": (probe.lock_error or None) if made else str(probe), "unlocked_pages_may_leave": leave}
    if sys.platform == "darwin":
        facts["user_wire_limit_bytes"] = machine.sysctl_int("vm.user_wire_limit")
    where = "swap or compression" if leave else "nothing (no swap)"
    if not made:
        return facts, [Check("locking", "note", "unknown: no segment could be made (see zero-copy L2)")]
    if not probe.locked:
        detail = f"not allowed ({probe.lock_error}); unlocked L2 pages can be taken out of memory by {where}"
        return facts, [Check("locking", "fail" if leave else "note", detail, _lock_fix() if leave else None)]
    if lockable is None:
        return facts, [Check("locking", "ok", "allowed for any budget (mlock of a segment worked, no limit)")]
    if budget is not None and budget > lockable:
        detail = (f"the budget {format_size(budget)} is over the {format_size(lockable)} that may be locked: "
                  f"its pages can be taken out of memory by {where}")
        return facts, [Check("locking", "fail" if leave else "note", detail, _lock_fix() if leave else None)]
    if budget is not None:
        return facts, [Check("locking", "ok", f"the budget {format_size(budget)} fits the {format_size(lockable)} "
                             "that may be locked")]
    detail = f"allowed up to {format_size(lockable)}: pages of a larger budget can be taken out by {where}"
    return facts, [Check("locking", "warn" if leave else "note", detail, _lock_fix() if leave else None)]


def check_open_files() -> tuple[dict, list[Check]]:
    from moe_l2.daemon.gate import raise_fd_limit

    soft, hard = machine.open_files_limits()
    raised = machine.limit(raise_fd_limit())  # what moe-l2d does at start, done to this short-lived process
    facts = {"soft_files": soft, "hard_files": hard, "daemon_files": raised, "needed_files": machine.MIN_OPEN_FILES}
    detail = f"soft {_count(soft)}, hard {_count(hard)}: moe-l2d raises its soft limit to {_count(raised)}"
    if raised is not None and raised < machine.MIN_OPEN_FILES:
        fix = ("raise the hard limit: LimitNOFILE=65536 in the unit (systemd/moe-l2d.service has it), or nofile in "
               "/etc/security/limits.conf" if sys.platform != "darwin" else
               "raise the limit: sudo launchctl limit maxfiles 10240 unlimited (the launchd plist sets 10240)")
        return facts, [Check("open files", "fail", f"{detail}, under the {machine.MIN_OPEN_FILES} a daemon with "
                             "many shards and clients needs", fix)]
    return facts, [Check("open files", "ok", detail)]


def check_l2_pages(mounts: str | None = None) -> tuple[dict, list[Check]]:
    """Whether L2's segments get huge pages (Linux: /dev/shm's mount option)."""
    huge = machine.shm_huge_pages(mounts)
    facts = {"shm_huge": huge}
    if huge is None:
        return facts, []
    if huge in ("always", "within_size"):
        return facts, [Check("L2 pages", "ok", f"L2's records lie on 2 MiB pages (/dev/shm is mounted huge={huge})")]
    return facts, [Check("L2 pages", "note", f"L2's records lie on small pages (/dev/shm is mounted huge={huge}), "
                         "which made moe-l2d's loads 2.4x slower on a VM (docs/benchmarks.md, \"Huge pages for L2\"); "
                         "for huge pages (every user of /dev/shm gets them): mount -o remount,huge=within_size "
                         "/dev/shm")]


# What native/crc32.cpp runs on where the CPU has CRC instructions it can use (_native.CRC32_KIND).
CPU_CRC32 = {"vpclmulqdq": "512-bit carry-less multiplication", "pclmul": "128-bit carry-less multiplication",
             "arm-crc32": "the CRC32 instructions"}


def check_checksums() -> tuple[dict, list[Check]]:
    """What record checksums run on: every checked read of the model files (the default) computes one."""
    from moe_l2 import _native

    kind = _native.CRC32_KIND
    facts = {"crc32": kind}
    if kind in CPU_CRC32:
        return facts, [Check("checksums", "ok", f"records are checked with the CPU's CRC-32 ({CPU_CRC32[kind]}, "
                                                f"{kind})")]
    return facts, [Check("checksums", "note", f"records are checked with {kind} CRC-32 code: this CPU has no CRC "
                         "instructions the build can use, so a checked read of the model files (the default, "
                         "--verify-checksums file) costs several times what it does with them")]


def check_model(text: str, budget: int | None) -> tuple[dict, list[Check], int | None]:
    """Direct I/O on the model's filesystem, a short read of its largest file, and the plan's split; returns the
    shared memory moe-l2d would take for this model at `budget` (None: the plan's), as its budget check counts it
    (a budget past every expert buys every expert and no more)."""
    from moe_l2.layout import BudgetError, Geometry
    from moe_l2.model import ModelFiles
    from moe_l2.model.location import resolve_model
    from moe_l2.plan import ModelSizes, plan, read_memory

    files = ModelFiles.open(resolve_model(text))
    biggest = max(files.files, key=os.path.getsize)
    supported = machine.direct_io_supported(biggest)
    speed = machine.measure_read(biggest, direct=supported)
    p = plan(read_memory(), ModelSizes.of(files))
    facts = {"path": str(files.path), "format": files.format, "direct_io_supported": supported,
             "direct_io_default": files.direct_default and supported,
             "read": {"path": speed.path, "read_bytes": speed.nbytes, "elapsed_s": speed.seconds, "mb_s": speed.mb_s,
                      "direct": speed.direct, "cached_before_bytes": speed.cached_before},
             "plan": {"l2_budget_bytes": p.l2_budget, "l2_slots": p.l2_slots, "l0_slots": p.l0_slots,
                      "l0_shared": p.l0_shared, "l0_per_process_bytes": p.l0_per_process, "processes": p.processes}}
    checks = []
    if files.direct_default and not supported:
        checks.append(Check("direct I/O", "fail", f"{biggest}'s filesystem has none: this packed model's misses go "
                            "through the page cache, which a model larger than memory churns",
                            "move the model to a local filesystem with direct I/O (ext4, XFS, APFS); network and "
                            "FUSE mounts often have none"))
    elif files.direct_default:
        checks.append(Check("direct I/O", "ok", "packed: each miss is one direct read"))
    else:
        checks.append(Check("direct I/O", "note", f"{'supported' if supported else 'not supported'} here; this "
                            f"{files.format} model is read through the page cache: `moe-l2 pack --model {text} --out "
                            "DIR` makes each miss one direct read"))
    how = "direct" if speed.direct else "buffered"
    if not speed.direct and speed.cached_before * 2 >= speed.nbytes:
        how += ", mostly from the page cache: memory's speed, not the disk's"
    checks.append(Check("read speed", "note", f"{speed.mb_s:.0f} MB/s: {format_size(speed.nbytes)} of "
                        f"{os.path.basename(speed.path)} in {speed.seconds * 1000:.1f} ms, {how}"))
    if p.l2_slots:
        checks.append(Check("plan", "note", f"one process: L2 {format_size(p.l2_budget)} ({p.l2_slots} of "
                            f"{p.n_experts} experts per layer), {p.l0_text} (moe-l2 plan --model "
                            f"{text} --processes N for more)"))
    else:
        checks.append(Check("plan", "warn", f"{format_size(p.available)} available leaves nothing for L2 beside one "
                            "process", "free memory, or give moe-l2d a --budget of what you can spare"))
    budget = budget if budget is not None else p.l2_budget if p.l2_slots else None
    try:
        needed = None if budget is None else Geometry.for_budget(files.n_layers, files.n_experts, files.layout.nbytes,
                                                                 budget).shm_bytes
    except BudgetError as exc:
        what, _, fix = str(exc).rpartition("; ")
        checks.append(Check("budget", "fail", what, fix))
        needed = None
    return facts, checks, needed


def check_daemon(address: str, timeout_s: float, leave: bool) -> tuple[dict, list[Check]]:
    from moe_l2 import control
    from moe_l2.runtime import resolve_runtime_dir

    directory, source = resolve_runtime_dir()
    facts = {"dir": str(directory), "dir_source": source, "socket": address, "socket_exists": None,
             "owner_uid": None, "owner_name": None, "trusted": None, "daemon_answers": False, "daemon": None,
             "problem": None}
    where = f"the runtime dir {directory} came from {source}"
    if address.startswith("ipc://"):
        try:
            uid = os.lstat(address[len("ipc://"):]).st_uid
            facts.update(socket_exists=True, owner_uid=uid, owner_name=control.owner(uid))
        except OSError:
            facts["socket_exists"] = False
            return facts, [Check("daemon", "note", f"none at {address} ({where}); without one moe-l2 reads experts "
                                 "from the model files: start one with moe-l2d --model DIR --budget SIZE "
                                 "(systemd/README.md)")]
    try:
        control.check_socket(address, control.trusted_uids())
        facts["trusted"] = True
    except control.UntrustedDaemon as exc:
        facts.update(trusted=False, problem=str(exc))
        reason, _, fix = str(exc).partition(": ")
        return facts, [Check("daemon", "fail", f"{address}: {reason}; clients refuse it", fix or None)]
    try:
        payload = control.stats(address, timeout_s)
    except (OSError, RuntimeError, control.MalformedReply) as exc:
        facts["problem"] = str(exc)
        return facts, [Check("daemon", "warn", f"no answer on {address} ({where}): {exc}")]
    d = payload["daemon"]
    facts.update(daemon_answers=True, daemon={"version": d["version"], "pid": d["pid"], "uptime_s": d["uptime_s"],
                                              "shm_bytes": d["shm_bytes"],
                                              "shm_unlocked_bytes": d.get("shm_unlocked_bytes"),
                                              "unbacked_slots": sum(m.get("unbacked_slots", 0)
                                                                    for m in payload["models"])})
    detail = f"moe-l2d {d['version']} pid {d['pid']} answers on {address}, socket owned by {facts['owner_name'] or '-'}"
    if d["version"] != __version__:
        return facts, [Check("daemon", "warn", f"{detail}: another version than this moe-l2 {__version__}",
                             "restart the daemon after upgrading (systemctl restart moe-l2d)")]
    unbacked = [m for m in payload["models"] if m.get("unbacked_slots")]
    if unbacked:
        return facts, [Check("daemon", "warn", f"{detail}; {unbacked[0]['unbacked_slots']} slots of L2 for "
                             f"{unbacked[0]['path']} cannot be backed and are out of use: "
                             f"{unbacked[0]['unbacked_error']}",
                             "make room in /dev/shm (df /dev/shm; remove what fills it, or enlarge it): the daemon "
                             "takes the slots back by itself once it can")]
    if d.get("shm_unlocked_bytes") and leave:
        return facts, [Check("daemon", "warn", f"{detail}; {format_size(d['shm_unlocked_bytes'])} of its shared "
                             "memory is not locked", _lock_fix())]
    return facts, [Check("daemon", "ok", detail), check_fills(facts, d.get("fills"))]


def check_fills(facts: dict, desk: dict | None) -> Check:
    """Whether this user's processes give the misses they read to L2 (daemon/fills.py): only a process of the
    daemon's uid may (the socket's owner is the daemon's uid)."""
    same = facts["owner_uid"] == os.geteuid()
    facts["fills"] = desk is not None and same
    if desk is None:
        return Check("fills", "note", "this daemon takes no fills (a tcp:// socket, or a daemon from before fills): "
                     "it reads every miss a process reports itself")
    if same:
        return Check("fills", "ok", "this user's processes read their misses and give them to L2: one disk read "
                     "per miss, theirs (they run as the daemon's user)")
    return Check("fills", "note", f"moe-l2d runs as {facts['owner_name'] or facts['owner_uid']}, not this user: "
                 "this user's processes may not write L2, so the daemon reads the misses they report (a second "
                 "read of each); run them as the daemon's user to fill L2 themselves")


# --- the report ------------------------------------------------------------------------------------------------


def diagnose(args: argparse.Namespace) -> tuple[dict, list[Check]]:
    budget = parse_size(args.budget) if args.budget is not None else None
    source = "--budget" if budget is not None else None
    report: dict = {
        "moe_l2": __version__,
        "platform": {"os": platform.system(), "release": platform.release(), "machine": platform.machine(),
                     "python": platform.python_version(), "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm")},
        "page_size_bytes": page_size(),
    }
    checks: list[Check] = []
    report["mlx"], found = check_backend()
    checks += found
    try:
        probe = machine.SegmentProbe.make()
    except OSError as exc:  # shared memory full, or no descriptor left: said by the checks that need a segment
        probe = exc
    try:
        report["zero_copy"], found = check_zero_copy(probe)
        checks += found
        if args.model is not None:
            report["model"], found, needed = check_model(args.model, budget)
            checks += found
            source = ("the shared memory " + ("--budget takes" if budget is not None else "of the plan's budget")
                      + " for this model")
            budget = needed
        report["locking"], found = check_locking(probe, budget)
        checks += found
    finally:
        if isinstance(probe, machine.SegmentProbe):
            probe.segment.close()
    found_facts, found = check_memory(machine.SharedMemoryRoom.read(), budget, source)
    report.update(found_facts)
    checks += found
    report["open_files"], found = check_open_files()
    checks += found
    report["l2_pages"], found = check_l2_pages()
    checks += found
    report["checksums"], found = check_checksums()
    checks += found
    report["runtime"], found = check_daemon(args.socket, args.timeout, report["locking"]["unlocked_pages_may_leave"])
    checks += found
    report["budget"] = {"checked_bytes": budget, "source": source}
    return report, checks


def render(report: dict, checks: list[Check]) -> str:
    p = report["platform"]
    lines = [f"moe-l2 doctor: {p['os']} {p['release']} {p['machine']}, Python {p['python']}; moe-l2 "
             f"{report['moe_l2']}, mlx {p['mlx']}, mlx-lm {p['mlx_lm']}; page size "
             f"{format_size(report['page_size_bytes'])}"]
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"  {MARKS[c.status]:4}  {c.name:{width}}  {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            lines.append(f"  {'':4}  {'':{width}}  fix: {c.fix}")
    failed = sum(c.status == "fail" for c in checks)
    lines.append(f"{failed} check(s) failed: moe-l2 would be slow or unsafe here" if failed else
                 "nothing here makes moe-l2 slow or unsafe")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        report, checks = diagnose(args)
    except (OSError, ValueError) as exc:  # a model that is not there or cannot be read, a bad --budget
        print(f"moe-l2 doctor: {exc}", file=sys.stderr)
        return 1
    failed = any(c.status == "fail" for c in checks)
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = not failed
    print(json.dumps(report, indent=1) if args.json else render(report, checks))
    return 1 if failed else 0
