"""DaemonProcess: moe-l2d in a subprocess, started as systemd starts it, for the demo, benchmarks and tests.

Ready means the daemon said READY=1 on its $NOTIFY_SOCKET (daemon/notify.py), which it does only once it
serves: no polling, and a start that fails is reported with the daemon's own log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from moe_l2 import _native

from moe_l2.lab import lifeline
from moe_l2.runtime import default_socket


def short_tempdir(prefix: str = "ml2-") -> Path:
    # An ipc:// path must fit sun_path (104 bytes on macOS); a default temp dir can be longer.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None))


class DaemonProcess:
    """`moe-l2d ARGS --runtime-dir DIR` in a subprocess; DIR is a fresh private directory unless given."""

    def __init__(self, args: list[str], runtime_dir: Path | None = None, log_path: Path | None = None,
                 wrapper: tuple[str, ...] = (), command: tuple[str, ...] | None = None):
        self.owns_dir = runtime_dir is None
        # The notify socket and the log live here; it is also the daemon's --runtime-dir unless args name one
        # (a test may aim the daemon at a directory under attack and keep its own files apart).
        self.runtime_dir = short_tempdir() if runtime_dir is None else Path(runtime_dir)
        self.args = list(args) if "--runtime-dir" in args else [*args, "--runtime-dir", str(self.runtime_dir)]
        daemon_dir = Path(self.args[self.args.index("--runtime-dir") + 1])
        self.socket = args[args.index("--socket") + 1] if "--socket" in args else default_socket(daemon_dir)
        self.env_runtime_dir = str(daemon_dir)
        self.wrapper = tuple(wrapper)  # a command that runs the daemon, e.g. with other limits or another uid
        # Tied to this process (lab/lifeline.py), so that a demo, bench or test run killed outright leaves no
        # daemon behind holding its segments; lifeline.command runs python -P, so that a source checkout in the
        # working directory does not shadow the installed package. A benchmark may run another revision's
        # daemon instead (bench/bench_flood.py).
        self.command = tuple(command or lifeline.command("moe_l2.daemon.main"))
        self.log_path = log_path or self.runtime_dir / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.segments: list[str] = []

    @classmethod
    def serving(cls, models, budget: int | str, *extra: str, **kwargs) -> "DaemonProcess":
        args = [a for m in models for a in ("--model", str(m))] + ["--budget", str(budget), *extra]
        return cls(args, **kwargs)

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        notify_path = self.runtime_dir / "notify"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        os.chmod(notify_path, 0o666)  # a daemon run as another user (wrapper) must reach it too
        notify.settimeout(0.2)
        # The runtime dir is its state dir too, unless args name one: a daemon started again in the same runtime
        # dir finds the heat its predecessor saved (daemon/warm_start.py), and no other daemon does.
        env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), MOE_L2_RUNTIME_DIR=self.env_runtime_dir,
                   STATE_DIRECTORY=self.env_runtime_dir)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.wrapper, *self.command, *self.args],
                                         stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if b"READY=1" in notify.recv(4096):
                        self.segments = self._listed_segments()
                        return self
                except TimeoutError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moe-l2d exited with {self.proc.returncode}:\n{self.log()}")
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"moe-l2d not ready after {timeout:g} s:\n{self.log()}")
        finally:
            notify.close()
            notify_path.unlink(missing_ok=True)

    def _listed_segments(self) -> list[str]:
        names = []
        dirs = {self.runtime_dir, Path(self.env_runtime_dir)}
        if self.socket.startswith("ipc://"):
            dirs.add(Path(self.socket[len("ipc://"):]).parent)  # the daemon keeps its list beside its socket
        for state in (p for d in dirs for p in d.glob("moe-l2d-*.segments")):
            try:
                names += [n for n in json.loads(state.read_text()) if isinstance(n, str)]
            except (OSError, ValueError):
                continue
        return names

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal the daemon and wait for it; returns its exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def leftover_segments(self) -> list[str]:
        """The daemon's segments that still exist (a clean stop unlinks them all)."""
        left = []
        for name in dict.fromkeys(self.segments + self._listed_segments()):
            try:
                _native.Segment.open(name, readonly=True).close()
            except (OSError, ValueError):
                continue
            left.append(name)
        return left

    def unlink_leftovers(self) -> list[str]:
        """Unlink what a killed daemon left (its successor would reclaim it; a caller may start none)."""
        left = self.leftover_segments()
        for name in left:
            _native.Segment.unlink(name)
        return left

    def cleanup(self) -> list[str]:
        """Stop, unlink leftovers and remove a private runtime dir; returns the segments that were left."""
        self.stop()
        left = self.unlink_leftovers()
        if self.owns_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return left

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
