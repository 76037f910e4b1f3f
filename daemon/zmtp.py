"""ZMTP 3 framing as the gate reads it (daemon/gate.py): what a client sends, frame header by frame header.

A ZMTP 3 stream (rfc.zeromq.org/spec/23) opens with a 64-byte greeting (signature 0xFF ... 0x7F, version,
security mechanism), then carries frames: a flags byte (MORE=1, LONG=2, COMMAND=4; the others reserved), a size
of 1 byte, or of 8 bytes big-endian with LONG, and the body. The gate follows the headers and skips the bodies,
so it knows at every byte whether a message (or a command) is unfinished, how many parts the message has had,
and how large each frame says it is; libzmq never tells (docs/security.md, "Connections and memory").
"""

from __future__ import annotations

from moe_l2 import protocol

# The largest frame relayed: twice protocol.MAX_FRAME_BYTES, so that a frame up to that still reaches the server
# and gets a FrameTooLarge reply; also the ROUTER's ZMQ_MAXMSGSIZE (daemon/server.py).
FRAME_LIMIT = 2 * protocol.MAX_FRAME_BYTES
# A CurveZMQ MESSAGE command wraps a frame in 33 bytes (name, nonce, box); handshake commands are smaller.
COMMAND_LIMIT = FRAME_LIMIT + 64
# Parts of one message a client may send: the ROUTER adds the identity to make protocol.MAX_PARTS.
MESSAGE_PARTS = protocol.MAX_PARTS - 1
GREETING_BYTES = 64
MORE, LONG, COMMAND = 1, 2, 4


class Refused(Exception):
    """What makes the gate close a connection: `kind` names the limit (the RefusalLog's kind)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class Framing:
    """The client's side of a ZMTP 3 stream as the gate reads it: the greeting, then only frame headers."""

    __slots__ = ("curve", "greeting", "header", "body_left", "parts", "last", "messages", "commands",
                 "command_limit")

    def __init__(self, curve: bool):
        self.curve = curve
        self.greeting = bytearray()
        self.header = bytearray()
        self.body_left = 0
        self.parts = 0  # parts of the message in progress
        self.last = False  # the frame in progress ends its message (or is a command)
        self.messages = 0  # messages and commands complete
        self.commands = 0  # commands begun (READY, PING, PONG; under CurveZMQ every message)
        self.command_limit: int | None = None

    @property
    def greeted(self) -> bool:
        return len(self.greeting) == GREETING_BYTES

    @property
    def unfinished(self) -> bool:
        """Inside a message or a command: libzmq holds what came of it so far."""
        return bool(self.parts or self.body_left or self.header)

    def feed(self, data: bytes, commands: int | None = None) -> None:
        """Follow `data`; raise Refused at the first byte past a limit, among them the first command past
        `commands` more (the gate's rate bound: a flood of PINGs is refused at its first frames, not parsed)."""
        self.command_limit = None if commands is None else self.commands + commands
        i, n = 0, len(data)
        while i < n:
            if len(self.greeting) < GREETING_BYTES:
                take = data[i:i + GREETING_BYTES - len(self.greeting)]
                self.greeting += take
                i += len(take)
                self._check_greeting()
            elif self.body_left:
                step = min(self.body_left, n - i)
                self.body_left -= step
                i += step
                if not self.body_left:
                    self._frame_done()
            elif not self.header and n - i >= 9:  # a whole header in hand, the usual case: read in place
                flags = data[i]
                _check_flags(flags)
                if flags & LONG:
                    size, i = int.from_bytes(data[i + 1:i + 9], "big"), i + 9
                else:
                    size, i = data[i + 1], i + 2
                self._frame(flags, size)
            else:
                self.header.append(data[i])
                i += 1
                flags = self.header[0]
                _check_flags(flags)
                if len(self.header) == (9 if flags & LONG else 2):
                    size = int.from_bytes(self.header[1:], "big")
                    self.header.clear()
                    self._frame(flags, size)

    def _check_greeting(self) -> None:
        g = self.greeting
        if g[0] != 0xFF or (len(g) > 9 and not g[9] & 1):
            raise Refused("bad framing", "not a ZMTP 3 greeting (an old ZeroMQ, or not ZeroMQ at all)")
        if len(g) > 10 and g[10] < 3:
            raise Refused("bad framing", f"ZMTP version {g[10]}; moe-l2d speaks 3 (libzmq 4 or later)")
        if len(g) == GREETING_BYTES:
            mechanism = bytes(g[12:32]).rstrip(b"\0").decode("ascii", "replace")
            if mechanism != ("CURVE" if self.curve else "NULL"):
                raise Refused("bad framing", f"security mechanism {protocol.quote(mechanism)}; this daemon "
                                             f"uses {'CURVE' if self.curve else 'NULL'}")

    def _frame(self, flags: int, size: int) -> None:
        if flags & COMMAND:
            if flags & MORE or self.parts:
                raise Refused("bad framing", "a command frame inside a message")
            if size > COMMAND_LIMIT:
                raise Refused("frame too large", f"a command of {size} bytes; the limit is {COMMAND_LIMIT}")
            self.last = True
            self.commands += 1
            if self.command_limit is not None and self.commands > self.command_limit:
                raise Refused("command flood", "more ZMTP commands (PINGs) than a client sends: the gate allows "
                                               "a burst of a few, then a few a second")
        else:
            if size > FRAME_LIMIT:
                raise Refused("frame too large", f"a frame of {size} bytes; the limit is {FRAME_LIMIT}")
            self.parts += 1
            if self.parts > MESSAGE_PARTS:
                raise Refused("too many parts", f"a message of more than {MESSAGE_PARTS} parts (an optional "
                                                "empty delimiter, the payload)")
            self.last = not flags & MORE
        self.body_left = size
        if not size:
            self._frame_done()

    def _frame_done(self) -> None:
        if self.last:
            self.parts = 0
            self.messages += 1


def _check_flags(flags: int) -> None:
    if flags & ~(MORE | LONG | COMMAND):
        raise Refused("bad framing", f"a frame with reserved flag bits ({flags:#04x})")
