"""Asking moe-l2d: the one way anything in moe-l2 sends the daemon a request and takes its reply.

The client's `request` and the trust checks of its L2Client, `moe-l2 stats`, `profile --from-daemon`,
`verify` (through L2Client), `bench` and the daemon's own metrics exporter all come here, so every one of them:

- refuses a daemon run by a user it does not trust before sending it anything: an ipc socket, or its directory,
  owned by another uid, or a link or file posing as the socket (`check_socket`); any local user can listen on
  the socket path or a TCP port while the real daemon is down (docs/security.md, "Clients trust only a daemon
  run by a trusted user");
- fails at once, naming the cause, when there is no socket file or the user may not use it (`check_access`);
- speaks CurveZMQ to a tcp:// daemon when the environment names the keys (`curve_keys`);
- takes a reply of at most protocol.MAX_REPLY_BYTES (ZMQ_MAXMSGSIZE: libzmq drops a larger one unread) and
  waits for it a bounded time;
- checks a stats reply's shape before anyone reads it (`stats`): a malformed one is a clear error, not a
  KeyError deep in a renderer; and writes the control characters of its strings (a client's name) as escapes.

The daemon's exporter asks over the server's inproc:// endpoint in the server's own ZeroMQ context (`context`):
inproc needs no socket permission and no CurveZMQ key, since it never leaves the process.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import stat

import zmq
import zmq.auth

from moe_l2 import protocol
from moe_l2.runtime import default_socket

log = logging.getLogger("moe-l2.control")

# The accounts the service files run moe-l2d as (systemd/README.md: Linux, macOS), trusted like root.
SERVICE_USERS = ("moe-l2", "_moe-l2")


class UntrustedDaemon(ValueError):
    """The socket or a segment belongs to a user this client does not trust, or others may write it."""


class MalformedReply(RuntimeError):
    """A reply that does not have the shape this release's daemon sends: another version, or an impostor."""


def trusted_uids(extra=()) -> frozenset[int]:
    """This process's user, root, the service account if it exists, `extra`, and $MOE_L2_TRUSTED_UIDS (user
    names or ids, comma-separated)."""
    uids = {os.getuid(), 0, *extra}
    names = [*SERVICE_USERS, *filter(None, (n.strip() for n in os.environ.get("MOE_L2_TRUSTED_UIDS", "").split(",")))]
    for name in names:
        if name.isdigit():
            uids.add(int(name))
            continue
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            if name not in SERVICE_USERS:
                log.warning("MOE_L2_TRUSTED_UIDS names user %r, who does not exist; ignored", name)
    return frozenset(uids)


def owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_socket(address: str, trusted: frozenset[int]) -> None:
    """Raise UntrustedDaemon unless an ipc socket and its directory belong to a trusted user (lstat: a link
    is refused, not followed). A tcp:// address has no owner to check: CurveZMQ's server key proves the daemon,
    and a client checks the owner of every segment it maps."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    for what, where in (("directory", os.path.dirname(os.path.abspath(path))), ("socket", path)):
        try:
            st = os.lstat(where)
        except OSError:
            return  # nothing listens there yet, or this user cannot reach it: nothing to trust or refuse
        if st.st_uid not in trusted:
            raise UntrustedDaemon(f"the {what} {where} belongs to {owner(st.st_uid)}, whom this client does not "
                                  "trust: another user may be posing as moe-l2d; if that user runs your daemon, "
                                  "add it to MOE_L2_TRUSTED_UIDS")
        if what == "socket" and not stat.S_ISSOCK(st.st_mode):
            raise UntrustedDaemon(f"{where} is not a socket (mode {stat.filemode(st.st_mode)}): remove it and "
                                  "restart moe-l2d")


def check_access(address: str) -> None:
    """Fail at once, naming the cause, where ZeroMQ itself would only wait and the caller report 'is it
    running?': no socket file at an ipc:// address (ConnectionRefusedError: no daemon will answer there), or one
    this user may not connect to (PermissionError)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConnectionRefusedError(f"no moe-l2d at {address}: the socket file does not exist; start the daemon "
                                     "(systemctl start moe-l2d, or moe-l2d --model DIR --budget SIZE), or give "
                                     "its address with --socket or MOE_L2_RUNTIME_DIR") from None
    except PermissionError:
        raise PermissionError(f"cannot reach {path}: its directory {os.path.dirname(path)} is closed to this user; "
                              "ask the admin to add you to the daemon's group (docs/security.md)") from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(f"no permission to connect to {path} (owner {owner(st.st_uid)}, group {st.st_gid}, "
                              f"mode {stat.S_IMODE(st.st_mode):o}): ask the admin to add you to that group, or "
                              "to start moe-l2d with --socket-mode 660 (docs/security.md)")
    if stat.S_ISSOCK(st.st_mode) and not listening(path):
        raise ConnectionRefusedError(f"no moe-l2d listens at {address}: the socket file is left from a daemon that "
                                     "stopped or crashed; start the daemon (systemctl start moe-l2d, or moe-l2d "
                                     "--model DIR --budget SIZE), which replaces it")


def listening(path: str) -> bool:
    """Whether anything accepts connections at an ipc socket file: a file left by a daemon that crashed refuses
    them at once, where ZeroMQ would only wait (the daemon's gate takes the probe and drops it unread)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # a full backlog, a path too long for sun_path: let ZeroMQ try and report
            return True
    return True


def access_problem(address: str) -> str | None:
    """Why this user cannot reach an ipc socket that exists (check_access's PermissionError), else None: for a
    client that would otherwise say only that no daemon answered."""
    try:
        check_access(address)
    except PermissionError as exc:
        return str(exc)
    except ConnectionRefusedError:
        pass
    return None


def curve_keys(address: str) -> tuple[bytes, bytes, bytes] | None:
    """For a tcp:// daemon that uses CurveZMQ: (its public key, this client's public and secret keys), from the
    certificate files named by $MOE_L2_CURVE_SERVER_KEY (the daemon's public certificate) and
    $MOE_L2_CURVE_CLIENT_CERT (this client's secret certificate). None when neither is set."""
    server, cert = os.environ.get("MOE_L2_CURVE_SERVER_KEY"), os.environ.get("MOE_L2_CURVE_CLIENT_CERT")
    if not address.startswith("tcp://") or not (server or cert):
        return None
    if not (server and cert):
        raise ValueError("CurveZMQ needs both $MOE_L2_CURVE_SERVER_KEY (the daemon's public certificate) and "
                         "$MOE_L2_CURVE_CLIENT_CERT (this client's secret certificate)")
    server_public, _ = zmq.auth.load_certificate(server)
    public, secret = zmq.auth.load_certificate(cert)
    if secret is None:
        raise ValueError(f"{cert} has no secret key: give this client's .key_secret certificate")
    return server_public, public, secret


def dealer(address: str, keys: tuple[bytes, bytes, bytes] | None, max_reply: int,
           context: zmq.Context | None = None, options=()) -> zmq.Socket:
    """A DEALER connected to the daemon that takes replies of at most `max_reply` bytes, with the socket
    `options` ((option, value) pairs) set before it connects; the caller closes it."""
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_reply)
    for option, value in options:
        sock.setsockopt(option, value)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)
    return sock


def request(address: str | None, message: protocol.Message, timeout_s: float = 5.0, *,
            trusted: frozenset[int] | None = None, context: zmq.Context | None = None) -> protocol.Reply:
    """One request and its reply on a short-lived socket.

    A fire-and-forget message is followed by a stats request on the same connection: the daemon handles a
    connection's messages in order, so the first reply is either the refusal of the message or the barrier's.
    No socket file at an ipc:// address, or one this user may not use, fails at once (check_access); a socket of
    a user not in `trusted` (default trusted_uids()) is refused before anything is sent (UntrustedDaemon).
    `context`: the daemon's own, for its inproc:// endpoint."""
    address = address or default_socket()
    frame = message.encode()
    if len(frame) > protocol.MAX_FRAME_BYTES:
        raise ValueError(f"a {message.TYPE} of {len(frame)} bytes exceeds the daemon's {protocol.MAX_FRAME_BYTES}-"
                         f"byte limit: split it (at most {protocol.MAX_IDS} expert ids per request)")
    check_access(address)
    try:
        check_socket(address, trusted_uids() if trusted is None else trusted)
    except UntrustedDaemon as exc:
        raise UntrustedDaemon(f"refusing moe-l2d on {address}: {exc}") from None
    sock = dealer(address, curve_keys(address), protocol.MAX_REPLY_BYTES, context)
    try:
        sock.send(frame)
        if not message.REPLIES:
            sock.send(protocol.Stats(id=message.id).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"moe-l2d did not answer on {address} within {timeout_s:g} s: is it running, or "
                               "still starting (a service starts with its first client: wait, or give more "
                               "--timeout)? (moe-l2 service status, systemctl status moe-l2d, or start it with "
                               "moe-l2d --model DIR --budget SIZE); "
                               f"a reply over {protocol.MAX_REPLY_BYTES >> 20} MiB is dropped unread, which looks "
                               "the same")
        try:
            reply = protocol.decode_reply(sock.recv())
        except protocol.ProtocolError as exc:
            raise MalformedReply(f"moe-l2d at {address} sent a malformed reply: {exc.evalue}; is it the same "
                                 "version? `moe-l2d --version`") from None
        return reply if message.REPLIES or not reply.ok else protocol.Reply(id=message.id, ok=True)
    finally:
        sock.close(0)


def stats(address: str | None, timeout_s: float = 5.0, *, routing: bool = False,
          context: zmq.Context | None = None) -> dict:
    """The daemon's stats reply, its shape checked (STATS_SHAPE): RuntimeError when refused, MalformedReply when
    it is not what this release's daemon sends."""
    address = address or default_socket()
    reply = request(address, protocol.Stats(id=1, routing=routing), timeout_s, context=context)
    if not reply.ok:
        raise RuntimeError(f"moe-l2d at {address} refused stats: {reply.ename}: {reply.evalue}")
    problem = shape_problem(reply.payload, STATS_SHAPE, "")
    if problem:
        raise MalformedReply(f"moe-l2d at {address} sent a malformed stats reply: {problem}; is it the same "
                             "version? `moe-l2d --version`")
    return _printable_strings(reply.payload)


def _printable_strings(value):
    """`value` with every string in it printable (protocol.printable): a stats reply carries names that clients
    gave the daemon, and its readers print them on this user's terminal."""
    if isinstance(value, str):
        return protocol.printable(value, len(value))
    if isinstance(value, dict):
        return {_printable_strings(k): _printable_strings(v) for k, v in value.items()}
    if isinstance(value, list) and not all(type(v) is int for v in value):
        return [_printable_strings(v) for v in value]
    return value


# What the readers of a stats reply (`moe-l2 stats` and --watch, `profile --from-daemon`, the metrics exporter)
# rely on. A shape is a type or a tuple of types, (None, shape) for nil or that shape, [shape] for a list, a map
# of fields (a name ending in "?" may be missing: a daemon from before it does not send it), or {"*": shape} for
# a map of any string keys.
_NUM = (int, float)
_COUNTERS = {name: int for name in protocol.PREFETCH_COUNTERS}
_TIERS = {name: int for name in protocol.TIER_COUNTERS}
_LAYER = {"layer?": int, "layer_id?": int, "resident": int, "loading": int, "pinned": int, "slots": int, "hits": int,
          "misses": int}
_MODEL = {
    "path": str, "fingerprint?": str, "policy": str, "n_layers": int, "n_experts": int, "slots_per_layer": int,
    "short_layers?": int, "served_layer_ids?": [int], "hit_rate": (None, _NUM), "hits": int, "misses": int,
    "picks?": int, "served_bytes": int, "loaded_bytes": int, "loads_done": int, "load_errors": int,
    "corrupt_records?": int, "corrupt_loads?": int, "corrupt?": [[int]], "loads_in_flight": int,
    "load_latency_p50_s": (None, _NUM), "load_latency_p99_s": (None, _NUM), "prefetch?": _COUNTERS, "tiers?": _TIERS,
    "shm_bytes": int,
    "released_bytes?": int, "unbacked_slots?": int, "unbacked_error?": (None, str), "layers": [_LAYER],
    "routing?": {"*": [[int]]},
    "warm_start?": (None, {"saved_at": _NUM, "records": int, "preloaded": int, "preloaded_bytes": int, "pending": int}),
}
_CLIENT = {"name": str, "pid": (None, int), "idle_s": _NUM, "layer_ids?": (None, [int]), "unserved_layer_ids?": [int],
           "tiers?": _TIERS, "l0_rows?": (None, int), "l0_ceiling?": (None, int)}
STATS_SHAPE = {
    "daemon": {
        "version": str, "pid": int, "socket": str, "uptime_s": _NUM, "rss_bytes": int, "clients": int,
        "client_list?": [_CLIENT], "requests": int, "errors": int, "loads_in_flight": int, "shm_bytes": int,
        "shm_locked_bytes?": int, "shm_unlocked_bytes?": int,
        "memory?": (None, {"available_bytes?": (None, int), "floor_bytes?": (None, int), "shrinks?": int,
                            "grows?": int}),
    },
    "models": [_MODEL],
}
_WHAT = {int: "an integer", float: "a number", str: "a string", type(None): "nil"}


def shape_problem(value, shape, where: str) -> str | None:
    """What in `value` does not fit `shape` (the first thing found, named by its path), or None."""
    if isinstance(shape, tuple) and None in shape:
        if value is None:
            return None
        shape = next(s for s in shape if s is not None)  # a shape or nil: (None, shape)
    if shape == [int] and isinstance(value, list) and all(type(v) is int for v in value):
        return None  # the long lists (routing counts, experts): at C speed
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where or 'the reply'} is {protocol.quote(value)}, not a list"
        for i, item in enumerate(value):
            problem = shape_problem(item, shape[0], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{where or 'the reply'} is {protocol.quote(value)}, not a map"
        if "*" in shape:
            for key, item in value.items():
                problem = (f"{where} has the key {protocol.quote(key)}, not a string" if not isinstance(key, str)
                           else shape_problem(item, shape["*"], f"{where}[{key!r}]"))
                if problem:
                    return problem
            return None
        for name, field in shape.items():
            key = name.rstrip("?")
            if key not in value:
                if name.endswith("?"):
                    continue
                return f"{where + '.' if where else ''}{key} is missing"
            problem = shape_problem(value[key], field, f"{where + '.' if where else ''}{key}")
            if problem:
                return problem
        return None
    types = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, types) and not isinstance(value, bool):
        return None
    return f"{where} is {protocol.quote(value)}, not {' or '.join(_WHAT.get(t, t.__name__) for t in types)}"
