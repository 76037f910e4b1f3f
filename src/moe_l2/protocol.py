"""Every message between clients and moe-l2d: types, fields, version, encoding.

Frames are msgpack maps. A request is ``{"v": PROTOCOL_VERSION, "type": ..., "id": ..., <fields>}``;
a reply is ``{"v": ..., "id": <request id>, "status": "ok"|"error", "ename": ..., "evalue": ..., <fields>}``.
Requests marked fire-and-forget (``report``, ``prefetch``) get a reply only when they are refused, so
nothing on a client's per-token path ever waits for the daemon. The daemon sends nothing unasked: a client that
waits for a record sleeps on the record's slot in shared memory (docs/architecture.md, "Shared memory").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1

# Every request is bounded in size and in the work it asks for, so that one cheap message never costs the
# daemon's serving thread more than milliseconds (docs/security.md, "Every request is bounded in work and
# memory").
# A control-plane message is small; anything bigger is a bug or an attack, refused with an error reply.
MAX_FRAME_BYTES = 256 << 10
# ZeroMQ frames of a request: the client's identity (added by the ROUTER), an optional empty delimiter
# (REQ sockets), the payload. A message with more is refused without keeping its extra parts.
MAX_PARTS = 3
# Expert ids (and layer keys) per request, all lists together: a report of this many ids takes the daemon
# about half a second of policy work, done in slices between other requests.
MAX_IDS = 16384
# Longest value of each string field, in characters.
MAX_STRING = {"model": 4096, "fingerprint": 64, "client": 256, "text": 64 << 10, "domain": 256, "kind": 32}
# Next-layer prefetch counters a report may carry: increments since the client's previous report, times in
# microseconds (docs/decisions.md, "Prefetch is counted"). Each at most 2**53, so any sum stays exact.
PREFETCH_COUNTERS = ("issued", "useful", "wasted", "guessed", "picked", "right", "worker_us", "wait_us")
# Where a client's expert lookups got their bytes, as a report may carry them (increments since its previous
# report, client.pool.TierCounts.by_source): its L0; L2, held when looked up; the disk, read by the daemon while
# the lookup waited (load-through) or by the client itself (docs/architecture.md, "Client pool (L0)").
TIER_COUNTERS = ("l0", "l2", "daemon_disk", "own_disk")
MAX_COUNTER = 2**53
# How much of a refused value an error message (and the daemon's log) quotes, and the longest reason a client
# takes from a reply.
QUOTE_CHARS = 64
MAX_REPLY_REASON = 2000
# The largest reply a client takes (ZMQ_MAXMSGSIZE of every asking socket: libzmq drops a larger one unread, so
# an impostor cannot make a client buffer what it likes; docs/security.md). The largest legitimate reply is a
# stats reply with routing counts: per model about 150 KB without routing for 94 MoE layers x 512 experts (every
# slot resident, the pin lists, the client list aside), plus per domain layers x experts counts of at most 9
# bytes each, 433 KB for that shape; 16 MiB holds that and 37 domains, and for every published MoE model (at most
# 60 x 384 or 48 x 512) over 70. The heartbeat socket of a client gets hello replies and refusals only, small
# like every request: MAX_FRAME_BYTES bounds it.
MAX_REPLY_BYTES = 16 << 20


def quote(value: Any) -> str:
    """repr(value), cut to QUOTE_CHARS characters: what an error message may echo of a hostile value."""
    sized = isinstance(value, (str, bytes, list, dict))
    text = repr(value[:QUOTE_CHARS] if isinstance(value, (str, bytes)) else value)
    if len(text) <= QUOTE_CHARS and not (sized and len(value) > QUOTE_CHARS):
        return text
    return f"{text[:QUOTE_CHARS]}... ({type(value).__name__} of length {len(value) if sized else len(text)})"


def printable(text: str, limit: int) -> str:
    """text cut to `limit` characters, with what a terminal would act on (control and format characters: escape
    sequences, newlines, bidirectional overrides) written as escapes: a peer's text as a log or stderr shows it."""
    text = text[:limit]
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version; req_id is the request's id when the
    frame got far enough to carry a valid one (0 otherwise), so that the refusal reaches its request."""

    def __init__(self, ename: str, evalue: str, req_id: int = 0):
        super().__init__(evalue)
        self.ename = ename
        self.evalue = evalue or ename
        self.req_id = req_id


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, not an int subclass


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _counters(names: tuple[str, ...]) -> tuple:
    return (lambda v: isinstance(v, dict)
            and all(k in names and _is_int(n) and 0 <= n <= MAX_COUNTER for k, n in v.items()),
            f"a map of counters ({', '.join(names)}) to integers 0..2**53")


# Field types a message may declare; each maps to a validator and a description for error messages.
_VALIDATORS = {
    str: (lambda v: isinstance(v, str), "a string"),
    int: (_is_int, "an integer"),
    bool: (lambda v: isinstance(v, bool), "a boolean"),
    "int_list": (_is_int_list, "a list of integers"),
    "layer_lists": (
        lambda v: isinstance(v, dict)
        and all(_is_int(k) and isinstance(p, list) and len(p) == 2 and all(map(_is_int_list, p))
                for k, p in v.items()),
        "a map layer -> [hit experts, missed experts]",
    ),
    "layer_experts": (
        lambda v: isinstance(v, dict) and all(_is_int(k) and _is_int_list(p) for k, p in v.items()),
        "a map layer -> expert ids",
    ),
    "counters": _counters(PREFETCH_COUNTERS),
    "tier_counters": _counters(TIER_COUNTERS),
    dict: (lambda v: isinstance(v, dict), "a map"),
    "str_or_none": (lambda v: v is None or isinstance(v, str), "a string or nil"),
    list: (lambda v: isinstance(v, list), "a list"),
}


@dataclass(frozen=True)
class Message:
    """Base of every request; subclasses declare TYPE, FIELDS and whether a reply is sent on success."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[dict[str, Any]] = {}
    REPLIES: ClassVar[bool] = True
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # fields a request may leave out (their defaults apply)

    id: int = field(default=0, kw_only=True)

    def encode(self) -> bytes:
        body = {"v": PROTOCOL_VERSION, "type": self.TYPE, "id": self.id}
        body.update({name: getattr(self, name) for name in self.FIELDS})
        return msgpack.packb(body, use_bin_type=True)


@dataclass(frozen=True)
class Hello(Message):
    """Attach to a model (also the client's heartbeat: the reply carries the daemon's epoch). `layers`: the MoE
    layers this client streams (a pipeline rank's), for `stats`; empty: not said (all); `l0_rows` and
    `l0_ceiling` likewise. Optional, so a hello from before the fields decodes, and an older daemon ignores
    them."""

    TYPE = "hello"
    FIELDS = {"model": str, "fingerprint": str, "client": str, "layers": "int_list", "l0_rows": int,
              "l0_ceiling": int}
    OPTIONAL = ("layers", "l0_rows", "l0_ceiling")
    model: str = ""
    fingerprint: str = ""
    client: str = ""
    layers: list[int] = field(default_factory=list)
    # The client's L0: rows held now and the most it may hold, in all layers (0..MAX_COUNTER); for `stats`.
    # Ceiling 0: not said (a client without a pool, or from before the fields).
    l0_rows: int = 0
    l0_ceiling: int = 0


@dataclass(frozen=True)
class Stats(Message):
    """The daemon's numbers; `routing` adds the online routing counts (large: one per layer and expert)."""

    TYPE = "stats"
    FIELDS = {"routing": bool}
    OPTIONAL = ("routing",)
    routing: bool = False


@dataclass(frozen=True)
class Hint(Message):
    """A prompt's text or a domain name: predict, preload and pin."""

    TYPE = "hint"
    FIELDS = {"model": str, "text": "str_or_none", "domain": "str_or_none"}
    model: str = ""
    text: str | None = None
    domain: str | None = None


@dataclass(frozen=True)
class Prefetch(Message):
    TYPE = "prefetch"
    FIELDS = {"model": str, "layer": int, "experts": "int_list"}
    REPLIES = False
    model: str = ""
    layer: int = 0
    experts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Report(Message):
    """What a client's lookups found in L2 (per layer the experts it copied and the ones it missed), and
    every expert its router picked, L0 hits included (per layer, one id per pick), for online statistics;
    with `prefetch`, what its next-layer prefetch did since its previous report (PREFETCH_COUNTERS); with
    `tiers`, where its lookups got their bytes since then (TIER_COUNTERS); with `notify`, per layer the misses
    the client waits for (load-through): the daemon folds such a report in as it comes, so that their loads start
    at once (the client sleeps on their slots meanwhile); with `given`, per layer the misses the client read
    itself and gives to L2 through the fill socket (src/moe_l2/fill_protocol.py): counted as misses, never loaded
    by the daemon; with `folded`, its lookups reached the policy through the fill socket already, each in order
    with its gives (`look`): counted, not observed again. All six are optional: a report from before one existed
    decodes with it empty, and an older daemon ignores `given` (it loads those misses as it always did)."""

    TYPE = "report"
    FIELDS = {"model": str, "layers": "layer_lists", "routed": "layer_experts", "prefetch": "counters",
              "tiers": "tier_counters", "notify": "layer_experts", "given": "layer_experts", "folded": bool}
    OPTIONAL = ("routed", "prefetch", "tiers", "notify", "given", "folded")
    REPLIES = False
    model: str = ""
    layers: dict[int, list[list[int]]] = field(default_factory=dict)
    routed: dict[int, list[int]] = field(default_factory=dict)
    prefetch: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, int] = field(default_factory=dict)
    notify: dict[int, list[int]] = field(default_factory=dict)
    given: dict[int, list[int]] = field(default_factory=dict)
    folded: bool = False


@dataclass(frozen=True)
class Pin(Message):
    TYPE = "pin"
    FIELDS = {"model": str, "layer": int, "experts": "int_list", "kind": str}
    model: str = ""
    layer: int = 0
    experts: list[int] = field(default_factory=list)
    kind: str = "permanent"


@dataclass(frozen=True)
class Unpin(Pin):
    TYPE = "unpin"


@dataclass(frozen=True)
class Bye(Message):
    TYPE = "bye"
    FIELDS = {"client": str}
    client: str = ""


PIN_KINDS = ("permanent", "domain")
REQUESTS: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Stats, Hint, Prefetch, Report, Pin, Unpin, Bye)
}


def _id_count(ftype: Any, value: Any) -> int:
    """Expert ids and layer keys in a validated field: what MAX_IDS bounds."""
    if ftype == "int_list":
        return len(value)
    if ftype == "layer_lists":
        return len(value) + sum(len(hits) + len(misses) for hits, misses in value.values())
    if ftype == "layer_experts":
        return len(value) + sum(map(len, value.values()))
    return 0


def decode_request(frame: bytes) -> Message:
    """Parse and validate one request frame; raises ProtocolError with an ename the reply carries and the
    request's id once the frame is a map with an integer id."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("FrameTooLarge", f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit: "
                                             f"split the request (at most {MAX_IDS} expert ids per request)")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("MalformedFrame", f"not a msgpack message: {type(exc).__name__}: "
                                              f"{quote(str(exc)) if str(exc) else 'undecodable bytes'}") from None
    if not isinstance(body, dict):
        raise ProtocolError("MalformedFrame", f"a request must be a msgpack map, not {type(body).__name__}")
    req_id = body.get("id", 0)
    if not _is_int(req_id):
        raise ProtocolError("BadField", f"field 'id' must be an integer, not {type(req_id).__name__}")
    try:
        return _decode_body(body, req_id)
    except ProtocolError as exc:
        exc.req_id = req_id
        raise


def _decode_body(body: dict, req_id: int) -> Message:
    version = body.get("v")
    # Each message is formatted only once its check failed: made for every field of every report and dropped, the
    # messages were half of a report's decode in moe-l2d.
    if version != PROTOCOL_VERSION:
        raise ProtocolError("VersionMismatch", f"protocol version {quote(version)} is not supported; this daemon "
                                               f"speaks version {PROTOCOL_VERSION}: install the same moe-l2 release "
                                               "for the client and the daemon")
    mtype = body.get("type")
    if not (isinstance(mtype, str) and mtype in REQUESTS):
        raise ProtocolError("UnknownType",
                            f"unknown message type {quote(mtype)}; known: {', '.join(sorted(REQUESTS))}")
    cls = REQUESTS[mtype]
    values = {}
    ids = 0
    for name, ftype in cls.FIELDS.items():
        valid, what = _VALIDATORS[ftype]
        if name not in body:
            if ftype != "str_or_none" and name not in cls.OPTIONAL:
                raise ProtocolError("BadField", f"{mtype}: missing field {name!r}")
            continue
        value = body[name]
        if not valid(value):
            raise ProtocolError("BadField", f"{mtype}: field {name!r} must be {what}, not {quote(value)}")
        if isinstance(value, str) and len(value) > MAX_STRING[name]:
            raise ProtocolError("BadField", f"{mtype}: field {name!r} is {len(value)} characters long; the limit is "
                                            f"{MAX_STRING[name]}")
        ids += _id_count(ftype, value)
        values[name] = value
    if ids > MAX_IDS:
        raise ProtocolError("TooManyIds",
                            f"{mtype}: {ids} expert ids and layers in one request; the limit is {MAX_IDS}: split it")
    return cls(id=req_id, **values)


def encode_reply(req_id: int, **payload: Any) -> bytes:
    body = {"v": PROTOCOL_VERSION, "id": req_id, "status": "ok"}
    body.update(payload)
    return msgpack.packb(body, use_bin_type=True)


def encode_error(req_id: int, ename: str, evalue: str) -> bytes:
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "id": req_id, "status": "error", "ename": ename, "evalue": evalue},
        use_bin_type=True,
    )


@dataclass(frozen=True)
class HelloReply:
    """What a hello's reply tells the client: the daemon's epoch and the model's segments and geometry, and the
    MoE layers the daemon serves (moe-l2d --layers); the client reads the others from the model files.

    `layers` is None for a daemon from before --layers, whose reply has no such field: it serves every layer.
    The field is new in a reply that kept its old fields, so PROTOCOL_VERSION stays 1: an older client ignores
    it (and then refuses a daemon that serves fewer layers at the index header, whose data segment names for
    the unserved layers are empty, reading everything from its files), and a newer client reads an older
    daemon's reply as serving all layers."""

    epoch: int
    fingerprint: str
    index_segment: str
    data_segments: list[str]
    n_layers: int
    n_experts: int
    n_slots: int
    record_bytes: int
    slot_stride: int
    layers: list[int] | None = None

    def encode(self, req_id: int) -> bytes:
        return encode_reply(req_id, **{name: getattr(self, name) for name in self.__dataclass_fields__})

    @classmethod
    def decode(cls, reply: Reply) -> "HelloReply":
        """From a decoded ok reply; ProtocolError("MalformedFrame") when a field is missing or of a wrong type."""
        values = {}
        for name, ftype in (("epoch", int), ("fingerprint", str), ("index_segment", str), ("data_segments", list),
                            ("n_layers", int), ("n_experts", int), ("n_slots", int), ("record_bytes", int),
                            ("slot_stride", int), ("layers", "int_list")):
            if name not in reply.payload and name == "layers":
                continue
            valid, what = _VALIDATORS[ftype]
            value = reply.payload.get(name)
            if not valid(value):
                raise ProtocolError("MalformedFrame",
                                    f"the daemon's hello reply has {quote(value)} for {name!r}, not {what}")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class Reply:
    id: int
    ok: bool
    ename: str = ""
    evalue: str = ""
    payload: dict[str, Any] = field(default_factory=dict)


def decode_reply(frame: bytes) -> Reply:
    return _reply(_unpack_daemon_frame(frame))


def _unpack_daemon_frame(frame: bytes) -> Any:
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError("MalformedFrame", f"daemon sent a frame that is not msgpack: {exc}") from None


def _reply(body: Any) -> Reply:
    if not (isinstance(body, dict) and body.get("status") in ("ok", "error")):
        raise ProtocolError("MalformedFrame", "daemon reply lacks a status")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("VersionMismatch", f"daemon speaks protocol version {quote(body.get('v'))}, this client "
                                               f"{PROTOCOL_VERSION}: install the same moe-l2 release for both")
    payload = {k: v for k, v in body.items() if k not in ("v", "id", "status", "ename", "evalue")}
    # A reply may come from an impostor (docs/security.md): what the client logs of it is a short, printable string.
    return Reply(id=body.get("id", 0), ok=body["status"] == "ok",
                 ename=printable(str(body.get("ename", "")), QUOTE_CHARS),
                 evalue=printable(str(body.get("evalue", "")), MAX_REPLY_REASON), payload=payload)
