"""A child process that ends with its parent: `moe-l2 bench` runs its daemon and its client processes this way, so
that a bench killed outright (SIGKILL from a timeout) leaves no orphan behind (docs/architecture.md, "The bench").

``python -P -m moe_l2.lab.lifeline PARENT_PID MODULE ARGS...`` asks for SIGTERM when PARENT_PID exits, then runs
MODULE as ``python -m MODULE ARGS...`` would. SIGTERM is the signal moe-l2d stops cleanly on (its segments
unlinked); a process with no handler for it just ends. Linux: PR_SET_PDEATHSIG. macOS: a thread waits on a
kqueue for the parent's exit (EVFILT_PROC, NOTE_EXIT), a notification rather than a poll.
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def command(module: str, parent: int | None = None) -> tuple[str, ...]:
    """The command line that runs MODULE tied to parent (default: this process)."""
    return (sys.executable, "-P", "-m", __name__, str(os.getpid() if parent is None else parent), module)


def _end() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_parent(parent: int) -> None:
    """SIGTERM this process once `parent` exits, and at once if it already has (its child was re-parented)."""
    if sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "[tie_to_parent] prctl(PR_SET_PDEATHSIG) failed")
    elif hasattr(select, "kqueue"):
        queue = select.kqueue()
        watch = select.kevent(parent, filter=select.KQ_FILTER_PROC, flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                              fflags=select.KQ_NOTE_EXIT)
        try:
            queue.control([watch], 0)
        except ProcessLookupError:
            _end()
        threading.Thread(target=lambda: (queue.control(None, 1), _end()), name="lifeline", daemon=True).start()
    else:
        raise OSError(f"[tie_to_parent] {sys.platform} has neither PR_SET_PDEATHSIG nor kqueue")
    # Registered after the fork: a parent gone in between is seen here, as a new parent pid.
    if os.getppid() != parent:
        _end()


def main() -> None:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit(f"usage: python -m {__name__} PARENT_PID MODULE [ARGS...]")
    tie_to_parent(int(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
