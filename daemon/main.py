"""moe-l2d: start, serve, stop cleanly. The lifecycle lives here; the work in the modules beside it."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from moe_l2 import _native
from moe_l2.cache.profile import Profile, ProfileError
from moe_l2.fill_protocol import fill_socket_path
from moe_l2.layout import SEGMENT_PREFIX, BudgetError, Geometry, describe_slots, new_token, segment_name
from moe_l2.machine import SharedMemoryRoom
from moe_l2.model import ModelFiles
from moe_l2.model.architecture import build_in_child_processes
from moe_l2.ranges import format_ranges
from moe_l2.model.location import resolve_model
from moe_l2.plan import ModelSizes, default_floor, plan, read_memory
from moe_l2.runtime import instance_tag
from moe_l2.sizes import format_size

from moe_l2.daemon import activation
from moe_l2.daemon.activation import ActivationError, Handed
from moe_l2.daemon.config import ConfigError, DaemonConfig, ModelConfig, build_parser, resolve
from moe_l2.daemon.gate import Gate, raise_fd_limit
from moe_l2.daemon.governor import Governor
from moe_l2.daemon.fills import FillDesk
from moe_l2.daemon.loader import Loader
from moe_l2.daemon.notify import sd_notify
from moe_l2.daemon.served import ServedModel
from moe_l2.daemon.server import INPROC_ADDRESS, Server
from moe_l2.daemon.warm_start import WarmStart

log = logging.getLogger("moe-l2d")


# Random names tried for one segment before the daemon gives up: a name is taken only on purpose, by someone
# creating files at names they cannot know (docs/architecture.md, "Shared memory").
NAME_ATTEMPTS = 4


class StartupError(RuntimeError):
    pass


@dataclass(frozen=True)
class OpenedModel:
    """A configured model opened and checked, before its segments are made (Daemon._open)."""

    config: ModelConfig
    files: ModelFiles
    geometry: Geometry
    profile: Profile | None
    layers: tuple[int, ...] | None  # the MoE layers served; None: all


def check_memory(needed: int) -> None:
    """Refuse a budget the machine cannot back, instead of dying of SIGBUS on a full /dev/shm later; the rules
    are moe_l2.machine's, which `moe-l2 doctor` reports."""
    refusal, warning = SharedMemoryRoom.read().check(needed)
    if refusal:
        raise StartupError("; ".join(refusal))
    if warning:
        log.warning("%s", warning)


def open_private_dir(path: Path) -> int:
    """An fd of `path` (made 0700 when missing) that the daemon may keep its lock and segment list in: a real
    directory, owned by the daemon's user, writable by nobody else. Anything else could be a directory another
    local user prepared, with links that make a root daemon overwrite or chmod files it never meant to
    (docs/architecture.md, "Runtime directory")."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"cannot create runtime directory {path}: {exc.strerror}; "
                           "set --runtime-dir or $MOE_L2_RUNTIME_DIR") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StartupError(f"runtime directory {path} is a symbolic link: check where it points and who "
                               "made it, then give the real directory as --runtime-dir (or the socket's)") from None
        raise StartupError(f"cannot open runtime directory {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    uid = os.geteuid()
    if info.st_uid != uid:
        problem = (f"belongs to uid {info.st_uid}, not to this daemon's user (uid {uid}); if you did not create "
                   f"it, another user did: remove it (rm -r {path}) and start again, or choose a directory of "
                   "this user's with --runtime-dir")
    elif info.st_mode & 0o022:
        problem = (f"is writable by other users (mode {stat_mode(info.st_mode)}); make it private with "
                   f"chmod go-w {path}")
    else:
        return fd
    os.close(fd)
    raise StartupError(f"runtime directory {path} {problem}")


def stat_mode(mode: int) -> str:
    return f"{mode & 0o7777:04o}"


def open_private_file(dir_fd: int, name: str, flags: int) -> int:
    """Open `name` in the runtime directory without following a link, and check it is this user's own file."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    info = os.fstat(fd)
    if not S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        os.close(fd)
        raise StartupError(f"{name} in the runtime directory is not a private file of this daemon's user "
                           f"(uid {info.st_uid}, mode {stat_mode(info.st_mode)}); remove it and start again")
    return fd


def check_tcp_address_free(address: str) -> None:
    """A TCP address has no directory to keep a lock in: before any segment is made, see that nobody listens on
    it, so that a daemon on the same address with another runtime dir is met here, not in shared memory."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            None if host == "*" else host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (OSError, ValueError):
        return  # an interface name or the like: ZeroMQ's own bind reports what is wrong
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no owner
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"another process (another moe-l2d with a different runtime dir?) listens on "
                                   f"{address}; stop it first or choose another --socket") from None


class Daemon:
    def __init__(self, config: DaemonConfig, rng: random.Random | None = None):
        """rng: a seeded Random that makes the segment names repeatable, for tests only (moe-l2d never passes
        one: its names come from `secrets`)."""
        self.config = config
        # The segment names (moe_l2.layout.segment_name), the lock and the segment list are all keyed by the
        # socket address in one spelling (moe_l2.runtime.canonical_address), and the lock lives beside an ipc://
        # socket: two daemons on one socket meet at the lock, however each spells it and whatever their
        # --runtime-dir, before either touches shared memory.
        self.tag = instance_tag(config.socket)
        self._rng = rng
        self._listed: list[str] = []  # the segment list: every name made, or about to be
        self.epoch = time.time_ns()
        self.models: list[ServedModel] = []
        self.loader: Loader | None = None
        self.server: Server | None = None
        self.gate: Gate | None = None  # owns the public socket, in front of the server (daemon/gate.py)
        self.fills: FillDesk | None = None  # takes the records clients of this uid read (daemon/fills.py)
        # Started with sockets from a service manager (daemon/activation.py): the socket file is the manager's.
        self._activated = False
        self._inherited: socket.socket | None = None  # the daemon's own among them, checked
        self.governor: Governor | None = None
        self.warm_start: WarmStart | None = None  # --warm-start: L2's heat saved and preloaded (daemon/warm_start.py)
        self._metrics = None  # the HttpServer of --metrics (daemon/http.py)
        self._dir_fd: int | None = None
        self._lock_fd: int | None = None
        self._stop = False
        self._served = False  # READY was sent: only then does stopping mean "stopped serving"

    @property
    def state_dir(self) -> Path:
        """Where the lock and the segment list live: an ipc:// socket's directory, else the runtime dir."""
        if self.config.socket.startswith("ipc://"):
            # As spelled, links unresolved: open_private_dir refuses a linked directory. Another spelling of the
            # same directory still finds the same lock there, named by the canonical address (self.tag).
            return Path(os.path.abspath(self.config.socket[len("ipc://"):])).parent
        return self.config.runtime_dir

    @property
    def _state_name(self) -> str:
        return f"moe-l2d-{self.tag}.segments"

    def _open(self, m: ModelConfig) -> OpenedModel:
        """A configured model's files, profile, served layers and geometry, each checked (StartupError says what
        is wrong); nothing is made yet."""
        try:
            # Never downloads: a repo id missing from the cache names the command that fetches it.
            files = ModelFiles.open(resolve_model(m.path))
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot serve {m.path}: {exc}") from None
        profile = None
        if m.profile is not None:
            try:
                profile = Profile.load(m.profile)
                profile.check_model(files.n_layers, files.n_experts, str(m.path))
            except ProfileError as exc:
                raise StartupError(f"cannot serve {m.path}: {exc}") from None
        try:
            layers = None if m.layers is None else files.moe_layers_in(m.layers)
        except ValueError as exc:
            raise StartupError(f"cannot serve {m.path} with --layers: {exc}") from None
        n_served = None if layers is None else len(layers)
        budget = m.budget if m.budget is not None else self._auto_budget(files, n_served)
        try:
            geometry = Geometry.for_budget(files.n_layers, files.n_experts, files.layout.nbytes, budget, n_served)
        except BudgetError as exc:
            raise StartupError(f"cannot serve {m.path}: {exc}") from None
        if budget - geometry.shm_bytes >= geometry.slot_stride:
            # Capped at one slot per expert: said, so that the admin does not count on memory L2 never takes,
            # nor on a budget the machine could never back (it would be refused once the model grew).
            room = SharedMemoryRoom.read()
            beyond = (f"this machine's memory ({room.refused_above_why()}) and more than "
                      if budget > room.refused_above else "")
            log.warning("--budget %s for %s is more than %severy expert of its %d served layers needs: L2 takes "
                        "%s; the rest stays free", format_size(budget), files.path, beyond, geometry.served,
                        format_size(geometry.shm_bytes))
        return OpenedModel(m, files, geometry, profile, layers)

    def _acquire_lock(self) -> None:
        directory = self.state_dir
        self._dir_fd = open_private_dir(directory)
        name = f"moe-l2d-{self.tag}.lock"
        try:
            fd = open_private_file(self._dir_fd, name, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise StartupError(f"cannot open the lock file {directory / name}: {exc.strerror}; if it is a "
                               "symbolic link, remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StartupError(f"another moe-l2d (pid {owner}) is already serving {self.config.socket}; "
                               "stop it first or choose another --socket") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if self.config.socket.startswith("tcp://"):
            check_tcp_address_free(self.config.socket)

    def _reclaim(self) -> None:
        """Unlink the segments a crashed predecessor listed; macOS cannot list /dev/shm, so it keeps a list.

        Only names with this daemon's tag, and only segments this daemon's user owns: a list that someone
        else wrote must not make a root daemon unlink other daemons' segments. Whatever holds a listed name now
        (a FIFO another user planted) is opened without blocking and left alone (Segment.unlink)."""
        try:
            fd = open_private_file(self._dir_fd, self._state_name, os.O_RDONLY)
        except FileNotFoundError:
            return
        except (OSError, StartupError) as exc:
            log.warning("ignoring the segment list %s: %s", self.state_dir / self._state_name, exc)
            return
        try:
            with os.fdopen(fd, "rb") as f:
                names = json.loads(f.read())
        except (OSError, ValueError):
            return
        prefix = f"{SEGMENT_PREFIX}{self.tag}"
        for name in names if isinstance(names, list) else []:
            if not (isinstance(name, str) and name.startswith(prefix)):
                log.warning("not reclaiming %r from the segment list: not a segment of this daemon", name)
                continue
            try:
                if _native.Segment.unlink(name, owner=os.geteuid()):
                    log.info("reclaimed shared-memory segment %s left by an earlier daemon", name)
            except (OSError, ValueError) as exc:
                log.warning("not reclaiming %s: %s", name, exc)

    def _new_segment(self, model_index: int, layer: int | None, nbytes: int) -> _native.Segment:
        """Model `model_index`'s index (layer None) or MoE layer's data segment, at a random name that is listed
        before it exists, so that a kill -9 at any point leaves nothing the next start cannot find. A name taken
        already (by someone who created files on purpose) gets another random part; after NAME_ATTEMPTS the
        start is refused, naming the file and who holds it."""
        for _ in range(NAME_ATTEMPTS):
            name = segment_name(self.tag, model_index, layer, new_token(self._rng))
            self._listed.append(name)
            self._write_state()
            try:
                return _native.Segment.create(name, nbytes, self.config.shm_mode)
            except FileExistsError as exc:
                self._listed.remove(name)
                taken = exc
        self._write_state()
        where = f", the file /dev/shm{name}" if sys.platform.startswith("linux") else ""
        raise StartupError(f"{NAME_ATTEMPTS} random shared-memory names in a row were taken; the last{where}: "
                           f"{taken}. Someone is creating files at this daemon's names to keep it from starting: "
                           "ask their owner, remove the files and start again")

    def _write_state(self) -> None:
        """Replace the segment list atomically; 0600 whatever the umask: a group member must not be able to
        make the next daemon unlink things."""
        names = json.dumps(self._listed).encode()
        partial = f"{self._state_name}.{os.getpid()}"
        try:
            os.unlink(partial, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir_fd)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, names)
        finally:
            os.close(fd)
        os.replace(partial, self._state_name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def start(self, handed: Handed | None = None) -> None:
        """handed: the sockets a service manager passed (activation.take); the daemon's is checked before
        anything is loaded, and served from instead of binding."""
        raise_fd_limit()  # the gate's connection cap comes from it
        self._acquire_lock()
        if handed is not None:
            self._activated = True
            try:
                self._inherited = activation.listener(handed, self.config.socket, self.config.socket_mode,
                                                      self.config.socket_group)
            except ActivationError as exc:
                raise StartupError(str(exc)) from None
            log.info("serving the socket %s passed (socket activation)", handed.manager)
        self._reclaim()
        opened = [self._open(m) for m in self.config.models]
        fingerprints = [o.files.fingerprint for o in opened]
        if len(set(fingerprints)) != len(fingerprints):
            raise StartupError("the same model is listed twice; serve each model once")
        check_memory(sum(o.geometry.shm_bytes for o in opened))
        for i, o in enumerate(opened):
            try:
                served = ServedModel(o.files, o.geometry,
                                     lambda layer, nbytes, i=i: self._new_segment(i, layer, nbytes),
                                     epoch=self.epoch, policy=o.config.policy, profile=o.profile,
                                     direct_io=o.config.direct_io, layers=o.layers)
            except (OSError, ValueError, StartupError) as exc:
                raise StartupError(f"cannot serve {o.config.path}: {exc}") from None
            self.models.append(served)
            g = o.geometry
            log.info("serving %s: decoder layers %s (%d of %d MoE layers) x %d experts, %s (%s of shared memory)",
                     o.files.path, format_ranges(served.layer_ids), g.served, g.n_layers, g.n_experts,
                     g.describe_slots(), format_size(served.shm_bytes))
        self._warn_unlocked()
        self.loader = Loader(self.config.loader_threads)
        if self.config.warm_start:
            # Before the socket is bound: no client's request meets a store whose policy and pins are not restored.
            self.warm_start = WarmStart(self.config.state_dir, self.models, self.loader)
            self.warm_start.restore()
            self.warm_start.start()
        memory = read_memory()
        floor = default_floor(memory.total) if self.config.memory_floor is None else self.config.memory_floor
        self.governor = Governor(self.models, floor)
        try:
            self.gate = Gate(self.config.socket, self.state_dir / f"moe-l2d-{self.tag}.gate",
                             mode=self.config.socket_mode, group=self.config.socket_group,
                             curve=self.config.curve is not None, listener=self._inherited)
            self.fills = self._fill_desk()
            self.server = Server(self.config.socket, self.models, self.loader, self.epoch, curve=self.config.curve,
                                 governor=self.governor, gate=self.gate, fills=self.fills)
        except Exception as exc:
            raise StartupError(f"cannot bind {self.config.socket}: {exc}") from None
        self.gate.start()
        if self.fills is not None:
            self.fills.start()
        self.governor.start()
        if self.config.metrics is not None:
            from moe_l2.daemon.metrics import serve_metrics  # prometheus_client only when asked for

            host, port = self.config.metrics
            try:
                self._metrics = serve_metrics(host, port, INPROC_ADDRESS, self.server.context)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror}; choose another "
                                   "--metrics address") from None
            log.info("metrics on http://%s:%d/metrics", host, port)

    def _fill_desk(self) -> FillDesk | None:
        """The fill desk beside an ipc:// socket (daemon/fills.py), or None: tcp://, a path too long to bind, or a
        directory the daemon may not create it in (a socket a service manager made); its clients' misses are then
        loaded by the daemon, as for a process of another user."""
        path = fill_socket_path(self.config.socket)
        if path is None:
            return None
        try:
            return FillDesk(path, self.models, self.loader, self.epoch)
        except OSError as exc:
            log.warning("no fill socket at %s (%s): processes will not fill L2 themselves; moe-l2d reads the misses "
                        "they report", path, exc.strerror or exc)
            return None

    def _auto_budget(self, files: ModelFiles, n_served: int | None) -> int:
        """--budget auto: what moe-l2 plan prints for this machine's memory and --processes, for the served
        layers' L2."""
        p = plan(read_memory(), ModelSizes.of(files, n_served), self.config.processes)
        if not p.l2_slots:
            raise StartupError(f"cannot serve {files.path} with --budget auto: {format_size(p.available)} of "
                               f"available memory leaves nothing for L2 beside {p.processes} process(es) and "
                               f"{format_size(p.os_headroom)} for the system (moe-l2 plan --model {files.path} "
                               "shows the split); give --budget SIZE or fewer --processes")
        log.info("budget auto: %s for L2 (%s), %s per process, for %d process(es) in %s available",
                 format_size(p.l2_budget), describe_slots(p.l2_slots, p.l2_short), p.l0_text, p.processes,
                 format_size(p.available))
        return p.l2_budget

    def _warn_unlocked(self) -> None:
        """Once per start: segments whose pages could not be locked can be swapped or compressed."""
        unlocked = [s for m in self.models for s in (m.index, *m.data.values()) if not s.locked]
        if unlocked:
            log.warning("%s (and %d more); %s of shared memory is committed but not locked, so the system may "
                        "swap or compress it: allow locking with LimitMEMLOCK=infinity (systemd) or a larger "
                        "ulimit -l, or run the daemon as root (see systemd/README.md)", unlocked[0].lock_error,
                        len(unlocked) - 1, format_size(sum(s.nbytes for s in unlocked)))

    def request_stop(self, *_) -> None:
        self._stop = True

    def serve(self) -> None:
        # Logged first: whoever waits for READY=1 then finds the line in the log.
        log.info("moe-l2d %d ready on %s", os.getpid(), self.config.socket)
        sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {len(self.models)} model(s)")
        self._served = True
        if self.config.socket.startswith("tcp://") and self.config.curve is None:
            log.warning("%s is reachable by every local user (TCP has no file mode); use the ipc:// socket "
                        "with --socket-mode to decide who may pin, unpin and prefetch (docs/security.md)",
                        self.config.socket)
        self.server.serve(lambda: self._stop)

    def stop(self) -> None:
        if self._lock_fd is None:
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
            return  # never started: the socket, state file and segments belong to someone else
        sd_notify("STOPPING=1")
        if self._metrics is not None:
            self._metrics.close()
        if self.governor is not None:
            self.governor.stop()
        if self.gate is not None:
            self.gate.close()
        if self.fills is not None:
            self.fills.close()
        if self.server is not None:
            self.server.close()
        if self.warm_start is not None:
            self.warm_start.stop(save=self._served)
        if self.loader is not None:
            self.loader.shutdown()
        for model in self.models:
            model.close()
        self.models = []
        try:
            os.unlink(self._state_name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        if self.config.socket.startswith("ipc://") and not self._activated:
            try:
                os.unlink(self.config.socket[len("ipc://"):])
            except OSError:
                pass
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = None
        if self._served:
            log.info("moe-l2d stopped; segments unlinked")
        elif self.models:
            log.info("start failed; the segments made so far are unlinked")


class JournalFormatter(logging.Formatter):
    """Under systemd (JOURNAL_STREAM set), each line starts with its syslog priority, <3> to <7>, which journald
    reads as the entry's priority; journald stamps the time itself (docs/architecture.md, "A live view and
    metrics")."""

    PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self):
        super().__init__("%(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = self.PRIORITIES.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = resolve(args)
    except ConfigError as exc:
        parser.error(str(exc))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if os.environ.get("JOURNAL_STREAM") else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    build_in_child_processes()  # learning a model's experts must not start a GPU device in the daemon
    daemon = Daemon(config)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    try:
        daemon.start(activation.take())
        daemon.serve()
    except (StartupError, ActivationError) as exc:
        print(f"moe-l2d: error: {exc}", file=sys.stderr)
        return 1
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
