"""Anthropic's Messages API (`POST /v1/messages`) on `moe-l2 serve`, as a translation of mlx_lm.server's chat
completions: a Messages request becomes a streamed chat-completions request that the server checks as any other
(serve/checks.py) and mlx_lm.server's own handler runs (its chat template, prompt cache and batching:
one implementation), and the chat chunks it writes become the Messages reply, streamed as Anthropic's
server-sent events or whole (docs/architecture.md, "moe-l2 serve").

`MessagesRoute` is the part of `StreamedAPIHandler` (serve/server.py) that does it; the functions and
`MessagesReply` are the translation itself and know nothing of HTTP but the status of a refusal.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from moe_l2.serve.checks import MAX_STOP_CHARS, MAX_STOPS, RequestRefused, stop_words_taken

__all__ = ["MessagesRequest", "MessagesReply", "MessagesRoute", "error_body", "stop_reason", "PATH"]

log = logging.getLogger("moe-l2.serve")

PATH = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 411: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}

# Messages fields passed to the chat request under the same name (checked there: serve/checks.py).
_SAME_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error object (which has no field for OpenAI's `param` and `code`)."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(content, where: str) -> str:
    """A message's content (a string or a list of text blocks) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestRefused(f"{where} must be a string or a list of content blocks", param=where)
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise RequestRefused(f"{where}.{i}: moe-l2 serve takes text blocks only ({{\"type\": \"text\", "
                                 f"\"text\": \"...\"}}), not {kind or type(block).__name__!r}", param=where)
        parts.append(block["text"])
    return "".join(parts)


@dataclass(frozen=True)
class MessagesRequest:
    """A Messages request as the chat-completions request it is run as."""

    chat: dict                   # the chat-completions body, always streamed, with its usage
    stream: bool                 # whether the client asked for server-sent events
    stop_sequences: tuple[str, ...]

    @classmethod
    def of(cls, body: dict) -> "MessagesRequest":
        """The translation of a request's body (a JSON object), or RequestRefused saying what to send instead."""
        if "max_tokens" not in body:
            raise RequestRefused("max_tokens: Field required (the most tokens to generate)", param="max_tokens")
        if body.get("tools") or body.get("tool_choice"):
            raise RequestRefused("moe-l2 serve runs no tools on /v1/messages: leave 'tools' out, or use "
                                 "/v1/chat/completions, which passes them to the model's chat template",
                                 param="tools")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestRefused("stream must be true or false", param="stream")
        stops = body.get("stop_sequences") or []
        if not stop_words_taken(stops):
            raise RequestRefused(f"stop_sequences must be a list of at most {MAX_STOPS} strings, each of 1 to "
                                 f"{MAX_STOP_CHARS} characters", param="stop_sequences")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRefused("messages must be a non-empty list of {\"role\", \"content\"}", param="messages")
        chat_messages = []
        if body.get("system"):
            chat_messages.append({"role": "system", "content": _text(body["system"], "system")})
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant"):
                raise RequestRefused(f"messages.{i}.role must be 'user' or 'assistant'", param="messages")
            chat_messages.append({"role": role, "content": _text(message.get("content"), f"messages.{i}.content")})
        chat = {name: body[name] for name in _SAME_FIELDS if name in body}
        chat.update(messages=chat_messages, stream=True, stream_options={"include_usage": True})
        if stops:
            chat["stop"] = stops
        return cls(chat, stream, tuple(stops))


def stop_reason(finish_reason: str | None, tokens: list[int], tokenizer,
                stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat completion's finish: mlx-lm says "stop" both for an
    end-of-sequence token and for a stop word, which it matches as the tokens `encode(word)` ends with."""
    if finish_reason == "length":
        return "max_tokens", None
    if tokens and tokens[-1] not in tokenizer.eos_token_ids:
        for word in stop_sequences:
            ids = tokenizer.encode(word, add_special_tokens=False)
            if ids and tokens[-len(ids):] == ids:
                return "stop_sequence", word
    return "end_turn", None


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class MessagesReply:
    """One request's Messages reply, made from the chat-completion chunks mlx_lm.server writes for it."""

    def __init__(self, request: MessagesRequest, model: str, input_tokens: int):
        self.request = request
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.input_tokens = input_tokens
        self.output_tokens = 0
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.stop: tuple[str, str | None] | None = None  # (stop_reason, stop_sequence), once ended

    def start(self) -> list[dict]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat-completion chunk (its text), or none (the usage chunk)."""
        if chunk.get("usage"):
            self.input_tokens = chunk["usage"]["prompt_tokens"]
            self.output_tokens = chunk["usage"]["completion_tokens"]
        events = []
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                self.text.append(text)
                events.append({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": text}})
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def end(self, stop: tuple[str, str | None]) -> list[dict]:
        self.stop = stop
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        return [{"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                 "usage": usage},
                {"type": "message_stop"}]

    def message(self) -> dict:
        """The whole reply, once `end` was called."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": "".join(self.text)}],
                "stop_reason": self.stop[0], "stop_sequence": self.stop[1],
                "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}}


class _ChunkWriter:
    """Stands in for the handler's wfile while mlx_lm.server writes a streamed chat completion's server-sent
    events (`data: {chunk}`, `: keepalive`, `data: [DONE]`): each becomes the Messages reply's events."""

    def __init__(self, route: "MessagesRoute", wfile):
        self.route = route
        self.wfile = wfile
        self.pending = b""

    def write(self, data: bytes) -> int:
        self.pending += data
        while b"\n\n" in self.pending:
            event, self.pending = self.pending.split(b"\n\n", 1)
            self.route.chat_event(event)
        return len(data)

    def flush(self) -> None:
        self.wfile.flush()


class MessagesRoute:
    """`POST /v1/messages` for a subclass of mlx_lm.server's APIHandler (serve/server.py): the handler reads
    the body, has it translated (`translate_messages`), puts the chat request in its place and runs it through
    `run_messages` (APIHandler.do_POST, as a streamed chat completion); the handler's wfile is swapped for a
    _ChunkWriter once mlx_lm.server has started its reply.

    The handler provides `send_json(status, body)`, `raw_wfile` (the connection), `started` (whether a byte of
    the reply is out), `observed` (the request's context and tokens: serve/generation.py's
    ObservedGenerator) and `model_id`."""

    messages_request: MessagesRequest | None = None
    reply: MessagesReply | None = None

    def translate_messages(self, body: dict) -> dict:
        """The chat-completions body a Messages request runs as; the request is then a chat completion's."""
        self.messages_request = MessagesRequest.of(body)
        self.path = "/v1/chat/completions"
        return self.messages_request.chat

    def run_messages(self, do_post) -> None:
        """Run the translated request with `do_post` (APIHandler.do_POST); a stream that fails ends with
        Anthropic's error event."""
        try:
            do_post()
        except ConnectionError:
            raise  # the client hung up: nothing to write to
        except Exception as exc:  # a failure during generation, after mlx_lm.server started the reply
            if not (self.started and self.messages_request.stream):
                raise  # no byte of the reply is out yet: the caller answers with an error
            log.exception("/v1/messages failed during generation")
            self.raw_wfile.write(sse(error_body(500, f"the generation failed: {exc}")))
            self.raw_wfile.flush()

    def start_messages_reply(self) -> None:
        """mlx_lm.server has its request's context and is about to write its chunks (a 200 reply)."""
        self.reply = MessagesReply(self.messages_request, self.model_id, len(self.observed.context.prompt))
        if self.messages_request.stream:
            super()._set_stream_headers(200)
            self.end_headers()
            self._send_events(self.reply.start())
        self.wfile = _ChunkWriter(self, self.raw_wfile)

    def chat_event(self, event: bytes) -> None:
        if event.startswith(b":"):  # mlx_lm.server's keepalive comment while the prompt is processed
            self._send_events([{"type": "ping"}])
            return
        data = event.partition(b"data: ")[2]
        if data != b"[DONE]":
            self._send_events(self.reply.chunk(json.loads(data)))
            return
        stop = stop_reason(self.reply.finish_reason, self.observed.tokens,
                           self.response_generator.model_provider.tokenizer, self.messages_request.stop_sequences)
        events = self.reply.end(stop)
        if self.messages_request.stream:
            self._send_events(events)
        else:
            self.send_json(200, self.reply.message())

    def _send_events(self, events: list[dict]) -> None:
        if self.messages_request.stream and events:
            self.raw_wfile.write(b"".join(sse(e) for e in events))
            self.raw_wfile.flush()
