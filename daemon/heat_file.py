"""The heat file: what one served model's L2 held when the daemon saved it, read back at the next start.

One file per model in the daemon's state dir, named by the model's fingerprint: a msgpack map of the format's
VERSION, the model's identity (fingerprint, MoE layers, experts), the eviction policy, when it was saved, the
active hint domain, and per MoE layer the experts held (hottest first), the pins by kind and the policy's state.

The file is input an attacker may have written or a crash may have cut short: it is opened without following a
link and without blocking (a FIFO), taken only as a regular file of the daemon's user that nobody else may write,
read only up to max_bytes for the model's size, and checked field by field before anything of it is used; the
policy's state is checked by the policy (moe_l2.cache.policy.restored_policy). Any fault is a HeatError, which
the daemon logs in one line before starting cold (docs/security.md, "Files moe-l2d reads back").
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import msgpack
import platformdirs

from moe_l2.atomic_file import AtomicFile
from moe_l2.cache.learned import PAIR_STATE_BYTES
from moe_l2.cache.policy import POLICIES
from moe_l2.cache.store import PIN_KINDS
from moe_l2.protocol import quote

VERSION = 3  # 2: the learned policy's state keeps its whole model; 3: and its weights from the layer before
# What a layer's entry may take at most, per expert of the model, per pair of experts and beside them: the learned
# policy's 46 numbers of each expert (its own weights and their mean squares for 4 horizons, counts, scores) take
# about 420 bytes as msgpack's doubles, the adaptive policy's under 100, the pins and held list a few more; its
# weights from expert to expert take PAIR_STATE_BYTES a pair.
EXPERT_BYTES = 512
LAYER_BYTES = 1024
HEAD_BYTES = 4096
MAX_DOMAIN_CHARS = 256
# The latest saved_at taken (seconds since the epoch, the year 2286): any later is no time this daemon wrote, and
# would overflow the conversions that show it.
MAX_SAVED_AT = 1e10
_FIELDS = ("version", "fingerprint", "n_layers", "n_experts", "policy", "saved_at", "active_domain", "layers")
_LAYER_FIELDS = ("layer", "experts", "pins", "policy_state")


class HeatError(ValueError):
    """Why a heat file is not taken."""


def default_state_dir() -> Path:
    """systemd's $STATE_DIRECTORY (its first entry), else the user's state dir: $XDG_STATE_HOME/moe-l2 or
    ~/.local/state/moe-l2 on Linux, ~/Library/Application Support/moe-l2 on macOS."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    return Path(platformdirs.user_state_dir("moe-l2", appauthor=False))


def file_name(fingerprint: str) -> str:
    return f"heat-{fingerprint}.msgpack"


def max_bytes(n_layers: int, n_experts: int) -> int:
    """The most bytes a heat file of a model of this size may hold; larger ones are not read."""
    return HEAD_BYTES + n_layers * (LAYER_BYTES + n_experts * EXPERT_BYTES + n_experts ** 2 * PAIR_STATE_BYTES)


@dataclass(frozen=True)
class LayerHeat:
    layer: int  # MoE layer
    experts: tuple[int, ...]  # held, hottest first
    pins: dict[str, tuple[int, ...]]  # by kind (moe_l2.cache.store.PIN_KINDS)
    policy_state: object  # the policy's state(), checked when restored


@dataclass(frozen=True)
class Heat:
    fingerprint: str
    n_layers: int
    n_experts: int
    policy: str
    saved_at: float  # seconds since the epoch
    active_domain: str | None
    layers: tuple[LayerHeat, ...]

    def encode(self) -> bytes:
        return msgpack.packb({
            "version": VERSION, "fingerprint": self.fingerprint, "n_layers": self.n_layers,
            "n_experts": self.n_experts, "policy": self.policy, "saved_at": self.saved_at,
            "active_domain": self.active_domain,
            "layers": [{"layer": h.layer, "experts": list(h.experts), "pins": {k: list(v) for k, v in h.pins.items()},
                        "policy_state": h.policy_state} for h in self.layers]}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes, fingerprint: str, n_layers: int, n_experts: int) -> "Heat":
        """The heat in `data`, checked against the model it must describe: HeatError says what is wrong."""
        try:
            body = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for garbage and cut files
            raise HeatError(f"not a heat file (cut short or damaged?): {type(exc).__name__}") from None
        if not isinstance(body, dict) or body.get("version") != VERSION:
            found = body.get("version") if isinstance(body, dict) else None
            raise HeatError(f"format version {quote(found)}, not {VERSION}")
        if set(body) != set(_FIELDS):
            raise HeatError(f"fields {quote(sorted(map(str, body)))}, not {', '.join(_FIELDS)}")
        if body["fingerprint"] != fingerprint:
            raise HeatError(f"it is another model's (fingerprint {quote(body['fingerprint'])}, not {fingerprint})")
        if (body["n_layers"], body["n_experts"]) != (n_layers, n_experts):
            raise HeatError(f"{quote(body['n_layers'])} layers x {quote(body['n_experts'])} experts, not {n_layers} x "
                            f"{n_experts}")
        if body["policy"] not in POLICIES:
            raise HeatError(f"policy {quote(body['policy'])} is none of {', '.join(POLICIES)}")
        saved_at = body["saved_at"]
        if type(saved_at) not in (int, float) or not 0 <= saved_at <= MAX_SAVED_AT:
            raise HeatError(f"saved_at {quote(saved_at)} is no time")
        domain = body["active_domain"]
        if domain is not None and (not isinstance(domain, str) or len(domain) > MAX_DOMAIN_CHARS):
            raise HeatError("active_domain is not a domain's name")
        layers = body["layers"]
        if not isinstance(layers, list) or len(layers) > n_layers:
            raise HeatError(f"layers is not a list of at most {n_layers}")
        decoded = tuple(_layer(entry, n_layers, n_experts) for entry in layers)
        if len({h.layer for h in decoded}) != len(decoded):
            raise HeatError("a layer is listed twice")
        return cls(fingerprint, n_layers, n_experts, body["policy"], float(saved_at), domain, decoded)


def _layer(entry, n_layers: int, n_experts: int) -> LayerHeat:
    if not isinstance(entry, dict) or set(entry) != set(_LAYER_FIELDS):
        raise HeatError(f"a layer's entry has not the fields {', '.join(_LAYER_FIELDS)}")
    layer = entry["layer"]
    if type(layer) is not int or not 0 <= layer < n_layers:
        raise HeatError(f"layer {quote(layer)} is not one of 0..{n_layers - 1}")
    pins = entry["pins"]
    if not isinstance(pins, dict) or not set(pins) <= set(PIN_KINDS):
        raise HeatError(f"layer {layer}'s pins are not lists by kind ({', '.join(PIN_KINDS)})")
    return LayerHeat(layer, _experts(entry["experts"], n_experts, f"layer {layer}'s experts"),
                     {kind: _experts(ids, n_experts, f"layer {layer}'s {kind} pins") for kind, ids in pins.items()},
                     entry["policy_state"])


def _experts(ids, n_experts: int, what: str) -> tuple[int, ...]:
    if not isinstance(ids, list) or len(ids) > n_experts:
        raise HeatError(f"{what} are not a list of at most {n_experts}")
    if not all(type(e) is int and 0 <= e < n_experts for e in ids) or len(set(ids)) != len(ids):
        raise HeatError(f"{what} are not distinct experts of 0..{n_experts - 1}")
    return tuple(ids)


def read(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of `name` in the directory, or None when there is no such file: HeatError for a link, a FIFO or
    anything else not a regular file, one not this user's or that others may write, or one over `limit` bytes."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HeatError("it is a symbolic link") from None
        raise HeatError(exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        if not S_ISREG(info.st_mode):
            raise HeatError("it is not a regular file")
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise HeatError(f"it is not a private file of this daemon's user (uid {info.st_uid}, mode "
                            f"{info.st_mode & 0o7777:04o})")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise HeatError(f"it holds more than the {limit} bytes a heat file of this model may hold")
        return b"".join(chunks)
    except OSError as exc:
        raise HeatError(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def write(directory: Path, dir_fd: int, name: str, data: bytes) -> None:
    """Replace `name` atomically (moe_l2.atomic_file: a private name, never a link followed, then rename)."""
    with AtomicFile(directory / name, 0o600, dir_fd=dir_fd) as f:
        f.write(data)
