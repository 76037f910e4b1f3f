"""The fill socket's messages: how a client gives moe-l2d the records it read itself (docs/architecture.md,
"Fills").

A client of the daemon's own uid that read a miss from the model file gives it to L2 instead of having the daemon
read it again: `give` names the records it holds, the daemon reserves a slot for each (seq odd) and sends an
`offer`, the client copies each record into its slot through a writable mapping of the data segment and says
`filled` (with the record's checksum) or `cancelled`. The daemon checks the slot's bytes and publishes them.
`look` names a layer's lookup (every expert the client looked up in L2) for the policy to observe, sent before the
lookup's `give`, so that the policy chooses a give's slot and victim knowing the batch that made its misses; it
is not answered (docs/decisions.md, "The policy sees a lookup before its give").

The socket is a Unix stream socket beside the control socket (`fill_socket_path`), mode 0600, whose peer the
daemon knows from the kernel (daemon/peers.py): it never takes a fill from another uid. Frames are a 4-byte
big-endian length and a msgpack map with a "type"; each is bounded (MAX_FRAME_BYTES, protocol.MAX_IDS ids), and a
frame that is malformed, oversized or of an unknown type closes the connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from moe_l2.protocol import MAX_IDS, MAX_STRING

MAX_FRAME_BYTES = 64 << 10
_LENGTH = struct.Struct(">I")
# The longest socket path both platforms bind (sun_path: 104 bytes on macOS, with its NUL).
MAX_PATH_BYTES = 100
SUFFIX = ".fill"

# Per type, its fields and their kinds: what a peer must send, nothing more.
_INT, _INTS, _STR, _PAIRS = "int", "int list", "string", "list of [expert, slot]"
FIELDS: dict[str, dict[str, str]] = {
    "look": {"model": _STR, "layer": _INT, "experts": _INTS},
    "give": {"model": _STR, "layer": _INT, "experts": _INTS, "keep": _INTS},
    "filled": {"model": _STR, "layer": _INT, "expert": _INT, "slot": _INT, "checksum": _INT},
    "cancelled": {"model": _STR, "layer": _INT, "expert": _INT, "slot": _INT},
    "welcome": {"epoch": _INT},
    "refused": {"reason": _STR},
    "offer": {"model": _STR, "layer": _INT, "slots": _PAIRS},
}


class FillProtocolError(ValueError):
    pass


def fill_socket_path(address: str) -> str | None:
    """The fill socket of the daemon at `address`: beside an ipc:// socket; None for tcp:// (no uid to check) or
    where the path would be too long to bind."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):] + SUFFIX
    return path if len(path.encode()) <= MAX_PATH_BYTES else None


def encode(kind: str, **fields) -> bytes:
    body = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def _valid(kind: str, value) -> bool:
    if kind == _INT:
        return type(value) is int and 0 <= value < 2**64  # an epoch is time.time_ns()
    if kind == _INTS:
        return isinstance(value, list) and len(value) <= MAX_IDS and all(type(v) is int for v in value)
    if kind == _STR:
        return isinstance(value, str) and len(value) <= MAX_STRING["text"]
    return (isinstance(value, list) and len(value) <= MAX_IDS
            and all(isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) for p in value))


@dataclass(frozen=True)
class FillMessage:
    type: str
    fields: dict

    def __getattr__(self, name: str):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None


class FrameReader:
    """Bytes in, whole messages out; FillProtocolError at the first frame that breaks the rules."""

    def __init__(self, accepted: tuple[str, ...]):
        self._buffer = bytearray()
        self._accepted = accepted

    def feed(self, data: bytes) -> list[FillMessage]:
        self._buffer += data
        out = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size > MAX_FRAME_BYTES:
                raise FillProtocolError(f"a frame of {size} bytes; the limit is {MAX_FRAME_BYTES}")
            if len(self._buffer) < _LENGTH.size + size:
                break
            body = bytes(self._buffer[_LENGTH.size:_LENGTH.size + size])
            del self._buffer[:_LENGTH.size + size]
            out.append(self._decode(body))
        return out

    def _decode(self, body: bytes) -> FillMessage:
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise FillProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind not in self._accepted:
            raise FillProtocolError(f"a message of type {str(kind)[:32]!r}; expected one of "
                                    f"{', '.join(self._accepted)}")
        fields = FIELDS[kind]
        if set(msg) != {"type", *fields}:
            raise FillProtocolError(f"{kind}: fields {sorted(map(str, msg))}, expected {sorted(['type', *fields])}")
        for name, what in fields.items():
            if not _valid(what, msg[name]):
                raise FillProtocolError(f"{kind}: field {name!r} must be {what}")
        return FillMessage(kind, {name: msg[name] for name in fields})
