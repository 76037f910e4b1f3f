"""Every message survives encode -> decode unchanged; every malformed frame is refused with a reason."""

import msgpack
import pytest

from moe_l2 import protocol
from moe_l2.protocol import ProtocolError

MESSAGES = [
    protocol.Hello(id=1, model="/models/q", fingerprint="ab" * 16, client="host:1:x"),
    protocol.Stats(id=2),
    protocol.Stats(id=10, routing=True),
    protocol.Hint(id=3, model="fp", text="integrate x^2 dx", domain=None),
    protocol.Hint(id=4, model="fp", text=None, domain="math"),
    protocol.Prefetch(id=5, model="fp", layer=2, experts=[1, 5, 7]),
    protocol.Report(id=6, model="fp", layers={0: [[1, 2], [3]], 11: [[], [4, 5]]}),
    protocol.Report(id=11, model="fp", layers={0: [[], [3]]}, routed={0: [3, 7, 7], 1: [2]}),
    protocol.Pin(id=7, model="fp", layer=1, experts=[0, 3], kind="domain"),
    protocol.Unpin(id=8, model="fp", layer=1, experts=[3], kind="permanent"),
    protocol.Bye(id=9, client="host:1:x"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: f"{m.TYPE}-{m.id}")
def test_request_round_trip(message):
    assert protocol.decode_request(message.encode()) == message


def test_every_request_type_is_covered():
    assert {m.TYPE for m in MESSAGES} == set(protocol.REQUESTS)


def test_optional_fields_may_be_left_out():
    assert protocol.decode_request(_raw(v=1, type="stats", id=3)) == protocol.Stats(id=3)
    report = protocol.decode_request(_raw(v=1, type="report", id=4, model="m", layers={}))
    assert report == protocol.Report(id=4, model="m")


def test_reply_round_trip():
    reply = protocol.decode_reply(protocol.encode_reply(42, epoch=7, data_segments=["/a", "/b"]))
    assert reply == protocol.Reply(id=42, ok=True, payload={"epoch": 7, "data_segments": ["/a", "/b"]})
    error = protocol.decode_reply(protocol.encode_error(43, "UnknownType", "no such type"))
    assert (error.id, error.ok, error.ename, error.evalue) == (43, False, "UnknownType", "no such type")


def _raw(**body):
    return msgpack.packb(body)


@pytest.mark.parametrize("frame, ename, words", [
    (b"\xc1\xff garbage", "MalformedFrame", "msgpack"),
    (msgpack.packb([1, 2]), "MalformedFrame", "map"),
    (_raw(v=99, type="stats", id=1), "VersionMismatch", "version 99"),
    (_raw(type="stats", id=1), "VersionMismatch", "None"),
    (_raw(v=1, type="launch", id=1), "UnknownType", "launch"),
    (_raw(v=1, type="hello", id=1, model="m", client="c"), "BadField", "fingerprint"),
    (_raw(v=1, type="prefetch", id=1, model="m", layer="0", experts=[1]), "BadField", "layer"),
    (_raw(v=1, type="prefetch", id=1, model="m", layer=0, experts=[1, "x"]), "BadField", "experts"),
    (_raw(v=1, type="report", id=1, model="m", layers={0: [[1]]}), "BadField", "layers"),
    (_raw(v=1, type="stats", id="x"), "BadField", "id"),
    (_raw(v=1, type="stats", id=1, routing="yes"), "BadField", "routing"),
    (_raw(v=1, type="report", id=1, model="m", layers={}, routed={0: [1, None]}), "BadField", "routed"),
    (b"\x00" * (protocol.MAX_FRAME_BYTES + 1), "FrameTooLarge", "limit"),
])
def test_bad_frames_are_refused_with_a_reason(frame, ename, words):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(frame)
    assert info.value.ename == ename
    assert words in info.value.evalue


def test_reply_from_other_version_is_refused():
    frame = msgpack.packb({"v": 2, "id": 1, "status": "ok"})
    with pytest.raises(ProtocolError, match="same moe-l2 release"):
        protocol.decode_reply(frame)
