"""AtomicFile: a file written under a private name beside its final path, then renamed into place.

Whatever moe-l2 writes may land in a directory other users can write (a shared model cache, /tmp), and it may
run as root. A fixed temporary name there (`NAME.partial`) is a name another user can plant a link at, and a
root process that opens it with O_CREAT|O_TRUNC writes through the link into any file of the machine. So the
temporary file gets a random name, is created with O_CREAT|O_EXCL|O_NOFOLLOW (a planted link or file makes the
open fail, never followed) and mode 0600, gets its intended mode through its descriptor only when complete, and
is renamed into place relative to a descriptor of its directory (rename replaces a link; it never follows one);
docs/security.md, "Files moe-l2 writes".

A writer that adds to a file (`keep=True`: a trace that runs append to) starts its private copy from the file at
the path, and so reads it first: only a regular file of this user with no other name, or a link planted there
would have root copy the file it names (a secret, through a hard link) into one others may read.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

__all__ = ["AtomicFile", "UnsafeFile", "final_name", "open_dir"]

# Random names tried before giving up: another user can take a name only by guessing it.
_ATTEMPTS = 16
_PRIVATE = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{16}\.partial$")
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_COPY_CHUNK = 1 << 20


class UnsafeFile(PermissionError):
    """The file a writer was to add to is one it must not read: a link, not a regular file, another user's, or
    one with other names (hard links)."""


def final_name(name: str) -> str | None:
    """The final name of a private partial file's name (what an interrupted writer left behind), else None."""
    match = _PRIVATE.match(name)
    return match["name"] if match else None


class AtomicFile:
    """`with AtomicFile(path) as f: f.write(data)`: `path` holds the new bytes, with `mode`, once the block
    ends; an exception removes the partial file and leaves `path` as it was. `sync` makes the data durable
    before the rename (a subclass may do more: see the packer).

    dir_fd: a descriptor of path's directory, for a writer that opened it once (the packer: then another user
    who can rename that directory cannot swap it for a link between one file and the next); else it is opened
    by path here. keep: start from the bytes and mode of the file now at path, if any (UnsafeFile when it is
    not one this user may safely copy, see above)."""

    def __init__(self, final: str | os.PathLike, mode: int = 0o644, *, dir_fd: int | None = None,
                 keep: bool = False):
        self.final = Path(final)
        self.mode = mode
        self.dir_fd = os.dup(dir_fd) if dir_fd is not None else open_dir(self.final.parent)
        self.fd = -1
        try:
            for _ in range(_ATTEMPTS):
                self.name = f".{self.final.name}.{secrets.token_hex(8)}.partial"
                try:
                    self.fd = os.open(self.name, _FLAGS, 0o600, dir_fd=self.dir_fd)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(f"cannot create a private file beside {self.final}: {_ATTEMPTS} random "
                                      "names were taken; someone is creating files in that directory")
            if keep:
                self._copy_existing()
        except BaseException:
            if self.fd >= 0:
                self.abort()
            else:
                os.close(self.dir_fd)
            raise

    def _copy_existing(self) -> None:
        """Copy the file at the final path, if any, into the private one and take its mode."""
        try:
            fd = os.open(self.final.name, _READ_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link (Linux and macOS both say ELOOP)
                raise UnsafeFile(f"{self.final} is a symbolic link: moe-l2 adds only to a file it can read without "
                                 "following a link another user may have planted (docs/security.md, \"Files moe-l2 "
                                 "writes\"); give the path it points to, or remove the link") from None
            raise
        try:
            st = os.fstat(fd)
            problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
                       else f"belongs to uid {st.st_uid}, not to this user" if st.st_uid != os.geteuid()
                       else f"has {st.st_nlink} names (hard links)" if st.st_nlink != 1 else None)
            if problem:
                raise UnsafeFile(f"{self.final} {problem}: moe-l2 adds only to a file of its own user with one name "
                                 "(docs/security.md, \"Files moe-l2 writes\"); remove it or give another path")
            while chunk := os.read(fd, _COPY_CHUNK):
                self.write(chunk)
            self.mode = stat.S_IMODE(st.st_mode)
        finally:
            os.close(fd)

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.name)

    def write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def sync(self) -> None:
        os.fsync(self.fd)

    def commit(self) -> None:
        """Give the file its mode, make it durable and rename it over the final path."""
        os.fchmod(self.fd, self.mode)
        self.sync()
        os.close(self.fd)
        self.fd = -1
        os.replace(self.name, self.final.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        os.close(self.dir_fd)
        self.dir_fd = -1

    def abort(self) -> None:
        """Close and remove the partial file (unlink removes a name, whatever it now names: never a target)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            try:
                os.unlink(self.name, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise


def open_dir(path: str | os.PathLike, dir_fd: int | None = None, *, follow: bool = True) -> int:
    """A descriptor of a directory (relative to dir_fd when given); follow=False refuses a link (OSError)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags if follow else flags | os.O_NOFOLLOW, dir_fd=dir_fd)
