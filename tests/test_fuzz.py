"""Property-based fuzzing of a real moe-l2d (issue 10): requests of every kind, every field of every type and size.

Each request is followed by a stats barrier on the same connection, so that every reply it earns (a refusal, or
the answer of a request that replies) is read before the next one. Afterwards the daemon must still be alive
and serve a client the model file's bytes.
"""

from __future__ import annotations

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_l2 import protocol
from moe_l2.client.connection import L2Client, request
from moe_l2.client.pool import ExpertPool

from .conftest import wait_for

# Every ename a refusal may carry; InternalError (a handler bug) is not one of them.
ENAMES = {"MalformedFrame", "FrameTooLarge", "VersionMismatch", "UnknownType", "BadField", "TooManyIds",
          "TooManyParts", "UnknownModel", "FingerprintMismatch", "OutOfRange", "NoProfile",
          "UnknownDomain", "NoPredictor", "Busy"}
FIELDS = sorted({name for cls in protocol.REQUESTS.values() for name in cls.FIELDS})


def fuzz_values(fingerprint: str, n_layers: int, n_experts: int):
    ids = st.integers(-2, n_experts + 1)
    layers = st.integers(-1, n_layers)
    # Long strings and lists around the limits, built by repetition (Hypothesis draws only short ones). No lone
    # surrogates, which no UTF-8 encoder sends (msgpack refuses them here): bytes that are not UTF-8 are fuzzed as
    # st.binary's.
    long_text = st.builds(lambda c, k: c * k, st.characters(exclude_categories=("Cs",)), st.integers(4000, 70_000))
    long_ids = st.builds(lambda e, k: [e] * k, ids, st.integers(protocol.MAX_IDS - 5, protocol.MAX_IDS + 5))
    scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | ids
               | st.text(max_size=64) | long_text | st.binary(max_size=64)
               | st.just(fingerprint) | st.sampled_from(["permanent", "domain"]))
    id_lists = st.lists(ids, max_size=40) | long_ids
    layer_lists = st.dictionaries(layers, st.tuples(st.lists(ids, max_size=20), st.lists(ids, max_size=20))
                                  .map(list), max_size=4)
    layer_experts = st.dictionaries(layers, st.lists(ids, max_size=30), max_size=4)
    nested = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(scalars.filter(
        lambda v: isinstance(v, (int, str))), c, max_size=5), max_leaves=20)
    return st.one_of(scalars, id_lists, layer_lists, layer_experts, nested)


def check_replies(sock, fuzz_id: int, barrier_id: int) -> None:
    while True:
        assert sock.poll(10_000), "daemon did not answer the barrier"
        reply = protocol.decode_reply(sock.recv())
        if reply.id == barrier_id and reply.ok and "daemon" in reply.payload:
            return
        assert reply.id in (fuzz_id, 0), reply
        if not reply.ok:
            assert reply.ename in ENAMES, reply
            assert reply.evalue and len(reply.evalue) < 2000, reply


def test_fuzzed_requests_get_clear_answers_and_the_daemon_serves_correct_bytes(running_daemon, model_files):
    fp, n_layers, n_experts = model_files.fingerprint, model_files.n_layers, model_files.n_experts
    values = fuzz_values(fp, n_layers, n_experts)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(running_daemon.socket)
    ids = iter(range(1, 1 << 30, 2))

    @given(mtype=st.sampled_from(sorted(protocol.REQUESTS)) | st.sampled_from(sorted(protocol.REQUESTS)) | values,
           version=st.just(protocol.PROTOCOL_VERSION) | values,
           fields=st.dictionaries(st.sampled_from(FIELDS), values, max_size=len(FIELDS)),
           keep_id=st.booleans())
    @settings(max_examples=200, deadline=5000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    def one_request(mtype, version, fields, keep_id):
        fuzz_id = next(ids)
        body = {"v": version, "type": mtype, **fields}
        if keep_id:
            body["id"] = fuzz_id
        sock.send(msgpack.packb(body, use_bin_type=True))
        sock.send(protocol.Stats(id=fuzz_id + 1).encode())
        check_replies(sock, fuzz_id if keep_id else 0, fuzz_id + 1)

    try:
        one_request()
    finally:
        sock.close(0)
    assert running_daemon.proc.poll() is None
    # Still serving: every expert through L2 is the file's record.
    for layer in range(n_layers):
        request(running_daemon.socket, protocol.Prefetch(id=1, model=fp, layer=layer, experts=[0, 1, 2]))
    wait_for(lambda: all(layer["loading"] == 0 and {0, 1, 2} <= set(layer["experts"]) for layer in
                         request(running_daemon.socket, protocol.Stats(id=2)).payload["models"][0]["layers"]),
             what="loads after the fuzz")
    client = L2Client(model_files, running_daemon.socket, wait_s=5)
    pool = ExpertPool(model_files, capacity=n_experts, client=client)
    try:
        assert client.attached
        for layer in range(n_layers):
            counts = pool.fetch(layer, list(range(n_experts)))
            assert counts.l2_hits >= 3
            for expert in range(n_experts):
                assert pool.layers[layer].record(expert) == model_files.read_record(layer, expert)
    finally:
        pool.close()
        client.close()
