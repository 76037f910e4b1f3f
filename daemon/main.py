"""moe-l2d: start, serve, stop cleanly. The lifecycle lives here; the work in the modules beside it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import time

import psutil

from moe_l2 import _native
from moe_l2.model import ModelFiles
from moe_l2.profile import Profile, ProfileError
from moe_l2.sizes import format_size

from .config import ConfigError, DaemonConfig, build_parser, resolve
from .loader import Loader
from .notify import sd_notify
from .served import ServedModel, plan_geometry
from .server import Server

log = logging.getLogger("moe-l2d")


class StartupError(RuntimeError):
    pass


def check_memory(needed: int) -> None:
    """Refuse a budget the machine cannot back, instead of dying of SIGBUS on a full /dev/shm later."""
    available = psutil.virtual_memory().available
    if needed > available:
        raise StartupError(f"the models need {format_size(needed)} of shared memory but only "
                           f"{format_size(available)} of memory is available; lower --budget")
    if os.path.isdir("/dev/shm"):  # Linux; macOS keeps POSIX shm in kernel memory, checked above
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
        if needed > free:
            raise StartupError(f"the models need {format_size(needed)} of shared memory but /dev/shm has "
                               f"{format_size(free)} free; lower --budget or enlarge /dev/shm "
                               "(e.g. mount -o remount,size=32G /dev/shm)")


class Daemon:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.tag = hashlib.sha1(config.socket.encode()).hexdigest()[:8]
        self.epoch = time.time_ns()
        self.models: list[ServedModel] = []
        self.loader: Loader | None = None
        self.server: Server | None = None
        self._lock_fd: int | None = None
        self._stop = False

    @property
    def _state_path(self):
        return self.config.runtime_dir / f"moe-l2d-{self.tag}.segments"

    def _acquire_lock(self) -> None:
        directory = self.config.runtime_dir
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create runtime directory {directory}: {exc.strerror}; "
                               "set --runtime-dir or $MOE_L2_RUNTIME_DIR") from None
        path = directory / f"moe-l2d-{self.tag}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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

    def _reclaim(self) -> None:
        """Unlink the segments a crashed predecessor listed; macOS cannot list /dev/shm, so it keeps a list."""
        try:
            names = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return
        for name in names:
            if isinstance(name, str) and name.startswith("/ml2") and _native.Segment.unlink(name):
                log.info("reclaimed shared-memory segment %s left by an earlier daemon", name)

    def _write_state(self) -> None:
        names = json.dumps([n for m in self.models for n in m.segment_names]).encode()
        # 0600 whatever the umask: a group member must not be able to make the next daemon unlink things.
        fd = os.open(self._state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, names)
        finally:
            os.close(fd)

    def start(self) -> None:
        self._acquire_lock()
        self._reclaim()
        opened = []
        for m in self.config.models:
            try:
                files = ModelFiles.open(m.path)
            except (OSError, ValueError) as exc:
                raise StartupError(f"cannot serve {m.path}: {exc}") from None
            profile = None
            if m.profile is not None:
                try:
                    profile = Profile.load(m.profile)
                    profile.check_model(files.n_layers, files.n_experts, str(m.path))
                except ProfileError as exc:
                    raise StartupError(f"cannot serve {m.path}: {exc}") from None
            opened.append((m, files, plan_geometry(files, m.budget), profile))
        fingerprints = [files.fingerprint for _, files, _, _ in opened]
        if len(set(fingerprints)) != len(fingerprints):
            raise StartupError("the same model is listed twice; serve each model once")
        needed = sum(g.index_bytes + g.n_layers * g.data_bytes for _, _, g, _ in opened)
        check_memory(needed)
        for i, (m, files, geometry, profile) in enumerate(opened):
            self.models.append(ServedModel(i, files, geometry, instance=self.config.socket, epoch=self.epoch,
                                           policy=m.policy, shm_mode=self.config.shm_mode, profile=profile,
                                           direct_io=m.direct_io))
            self._write_state()
            g = geometry
            log.info("serving %s: %d layers x %d experts, %d slots per layer (%s of shared memory)",
                     files.path, g.n_layers, g.n_experts, g.n_slots, format_size(self.models[-1].shm_bytes))
        self.loader = Loader(self.config.loader_threads)
        try:
            self.server = Server(self.config.socket, self.models, self.loader, self.epoch,
                                 socket_mode=self.config.socket_mode, socket_group=self.config.socket_group, curve=self.config.curve)
        except Exception as exc:
            raise StartupError(f"cannot bind {self.config.socket}: {exc}") from None

    def request_stop(self, *_) -> None:
        self._stop = True

    def serve(self) -> None:
        sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {len(self.models)} model(s)")
        log.info("moe-l2d %d ready on %s", os.getpid(), self.config.socket)
        if self.config.socket.startswith("tcp://") and self.config.curve is None:
            log.warning("%s is reachable by every local user (TCP has no file mode); use the ipc:// socket "
                        "with --socket-mode to decide who may pin, unpin and prefetch (docs/security.md)",
                        self.config.socket)
        self.server.serve(lambda: self._stop)

    def stop(self) -> None:
        if self._lock_fd is None:
            return  # never started: the socket, state file and segments belong to someone else
        sd_notify("STOPPING=1")
        if self.server is not None:
            self.server.close()
        if self.loader is not None:
            self.loader.shutdown()
        for model in self.models:
            model.close()
        self.models = []
        self._state_path.unlink(missing_ok=True)
        if self.config.socket.startswith("ipc://"):
            try:
                os.unlink(self.config.socket[len("ipc://"):])
            except OSError:
                pass
        os.close(self._lock_fd)
        self._lock_fd = None
        log.info("moe-l2d stopped; segments unlinked")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = resolve(args)
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    daemon = Daemon(config)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    try:
        daemon.start()
        daemon.serve()
    except StartupError as exc:
        print(f"moe-l2d: error: {exc}", file=sys.stderr)
        return 1
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
