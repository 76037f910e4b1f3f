"""What `moe-l2 serve` takes of a request, checked before mlx_lm.server sees any of it: the body (its
Content-Length against `--max-body-bytes` before a byte of it is read, then UTF-8 JSON of bounded nesting) and
every field mlx_lm.server reads, by type and range, for chat and text completions (and so for `/v1/messages`,
which runs as a chat completion). mlx_lm.server trusts what it is given: a `stop` that is not strings, a
`logit_bias` id past the vocabulary or an empty prompt kills its generation thread or the process; a `max_tokens`
of 2^70 runs until the context is full. A refusal is a `RequestRefused`: its status and the field it is about,
for the handler's error object (docs/security.md, "`moe-l2 serve`'s HTTP API").
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
from dataclasses import dataclass

__all__ = ["RequestRefused", "RequestLimits", "read_json", "check_completion", "model_size", "stop_words_taken",
           "MAX_STOPS", "MAX_STOP_CHARS"]

log = logging.getLogger("moe-l2.serve")

MAX_DEPTH = 64              # nesting of arrays and objects; a tool's JSON schema needs a dozen
LOGGED_BYTES = 200          # of a body refused as not JSON: the log says why and shows its start only
INDEX_MAX = 2**31 - 1       # mlx indexes arrays with 32-bit integers (a larger context size kills the thread)
SEED_MAX = 2**64 - 1        # mx.random.seed takes an unsigned 64-bit integer
TOP_LOGPROBS_MAX = 11       # mlx_lm.server's
MAX_STOPS = 64              # stop words are encoded on the generation thread, ahead of every other request
MAX_STOP_CHARS = 1000
_DIGITS = re.compile(r"[0-9]{1,19}")          # ASCII only: str.isdigit() takes "²", which int() refuses
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")
_IMAGE_PARTS = ("image_url", "input_image", "image")  # the content parts mlx_lm.server reads images from


class RequestRefused(ValueError):
    """A request this server does not serve: the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def model_size(config: dict, key: str) -> int | None:
    """A size of the model's config (`vocab_size`, `max_position_embeddings`), or of its text model's where it
    has one (multimodal configs), or None."""
    for where in (config, config.get("text_config") or {}):
        value = where.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class RequestLimits:
    """What one server takes of a request: from its options and its model."""

    body_bytes: int                # --max-body-bytes
    max_tokens: int                # the most a request may ask to generate
    max_tokens_bound: str          # what sets it, for the refusal
    default_max_tokens: int        # what a request that says nothing gets
    context: int | None            # the model's context in tokens, if its config says
    vocab: int | None              # the model's vocabulary (its logits), if its config says
    images: bool                   # whether the model takes images (mlx-lm found a processor for it)
    template_parameters: frozenset[str]  # apply_chat_template's own arguments: no template variables

    @classmethod
    def of(cls, provider) -> "RequestLimits":
        """From a loaded StreamedModelProvider (serve/server.py)."""
        args = provider.cli_args
        context = provider.context
        if context is not None and context < args.max_tokens_limit:
            max_tokens, bound = context, f"the model's context of {context} tokens"
        else:
            max_tokens, bound = args.max_tokens_limit, f"this server's --max-tokens-limit {args.max_tokens_limit}"
        inner = getattr(provider.tokenizer, "_tokenizer", provider.tokenizer)
        parameters = inspect.signature(inner.apply_chat_template).parameters.values()
        return cls(body_bytes=args.max_body_bytes, max_tokens=max_tokens, max_tokens_bound=bound,
                   default_max_tokens=min(args.max_tokens, max_tokens), context=context, vocab=provider.vocab,
                   images=provider.processor is not None,
                   template_parameters=frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD))


# ---- the body ---------------------------------------------------------------------------------------------


def read_json(headers, rfile, limit: int, where: str):
    """The request's body as JSON, read only once its Content-Length is known to be within `limit` bytes."""
    length = headers.get("Content-Length")
    if length is None:
        raise RequestRefused("a Content-Length header is required (the body's size in bytes)", 411)
    if not _DIGITS.fullmatch(length.strip()):
        raise RequestRefused(f"Content-Length must be the body's size in bytes (decimal digits), not {length[:40]!r}")
    size = int(length)
    if size > limit:
        raise RequestRefused(f"the body is {size} bytes; this server takes at most {limit} (its --max-body-bytes)",
                             413)
    raw = rfile.read(size)
    if len(raw) < size:
        raise RequestRefused(f"the body ended after {len(raw)} of its Content-Length's {size} bytes")
    try:
        body = json.loads(raw.decode(), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = "too deeply nested" if isinstance(exc, RecursionError) else str(exc)
        log.warning("%s: refused a body that is not JSON (%s): %r%s", where, reason, raw[:LOGGED_BYTES],
                    f"... ({size} bytes)" if size > LOGGED_BYTES else "")
        if isinstance(exc, UnicodeDecodeError):
            raise RequestRefused(f"the body is not UTF-8 (byte {exc.start}): send JSON in UTF-8") from None
        raise RequestRefused(f"Invalid JSON in request body: {reason}") from None
    if _depth(body) > MAX_DEPTH:
        raise RequestRefused(f"the body nests arrays and objects more than {MAX_DEPTH} deep")
    if not isinstance(body, dict):
        raise RequestRefused("the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value) -> int:
    """How deep arrays and objects nest in a parsed body, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((child, depth + 1) for child in children)
    return deepest


# ---- the fields -------------------------------------------------------------------------------------------


def _refuse(name: str, what: str):
    raise RequestRefused(f"{name} must be {what}", param=name.partition(".")[0])


def _boolean(name, value):
    if not isinstance(value, bool):
        _refuse(name, "true or false")
    return value


def _string(name, value):
    if not isinstance(value, str):
        _refuse(name, "a string")
    return value


def _integer(low: int, high: int, bound: str = ""):
    """`bound`: what sets `high`, said when it is passed."""
    def check(name, value):
        if not isinstance(value, int) or isinstance(value, bool):
            _refuse(name, "an integer")
        if value < low:
            _refuse(name, f"at least {low}")
        if value > high:
            _refuse(name, f"at most {high}" + (f" ({bound})" if bound else ""))
        return value
    return check


def _number(low: float | None = None, high: float | None = None):
    def check(name, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            _refuse(name, "a finite number")
        if low is not None and value < low:
            _refuse(name, f"at least {low}")
        if high is not None and value > high:
            _refuse(name, f"at most {high}")
        return float(value)  # mlx_lm.server takes some of these as floats only
    return check


def _top_logprobs(name, value):
    return -1 if value == -1 else _integer(0, TOP_LOGPROBS_MAX)(name, value)


def stop_words_taken(stops) -> bool:
    """Whether a list of stop words is one this server takes (also /v1/messages' stop_sequences)."""
    return (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops))


def _stops(name, value):
    stops = [value] if isinstance(value, str) else value
    if not stop_words_taken(stops):
        _refuse(name, f"a string or a list of at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_CHARS} characters")
    return stops


def _stream_options(name, value):
    if not isinstance(value, dict):
        _refuse(name, "an object, {\"include_usage\": true or false}")
    return {"include_usage": _boolean(f"{name}.include_usage", value.get("include_usage", False))}


def _logit_bias(vocab: int | None):
    def check(name, value):
        if not isinstance(value, dict):
            _refuse(name, "an object of token ids to numbers")
        if value and vocab is None:
            raise RequestRefused("this model's config gives no vocabulary size: leave logit_bias out", param=name)
        for key, bias in value.items():
            if not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) < vocab:
                _refuse(name, f"an object whose keys are token ids of this model (0 to {vocab - 1}), not {key[:40]!r}")
            _number()(f"{name}.{key}", bias)
        return value
    return check


def _template_kwargs(reserved: frozenset[str]):
    def check(name, value):
        if not isinstance(value, dict):
            _refuse(name, "an object of the chat template's variables")
        taken = sorted(reserved & value.keys())
        if taken:
            _refuse(name, "the chat template's variables only, not apply_chat_template's own arguments "
                          f"({', '.join(taken)})")
        return value
    return check


def _list_of_objects(name, value):
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        _refuse(name, "a list of objects")
    return value


def _role_mapping(name, value):
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        _refuse(name, "an object of roles to strings")
    return value


def _fields(limits: RequestLimits) -> dict:
    """Every field mlx_lm.server reads of a completion request but max_tokens, prompt and messages: its check,
    which gives the value passed on. A field given as null is left out, as if not given."""
    window = _integer(0, limits.context, "the model's context") if limits.context else _integer(0, INDEX_MAX)
    return {
        "model": _string, "draft_model": _string, "adapters": _string,
        "stream": _boolean, "stream_options": _stream_options, "logprobs": _boolean, "top_logprobs": _top_logprobs,
        "temperature": _number(0), "top_p": _number(0, 1), "min_p": _number(0, 1),
        # 0 is off; mlx-lm's top-k sampling raises (on the generation thread) from the vocabulary's size up
        "top_k": (_integer(0, limits.vocab - 1, f"below the model's vocabulary of {limits.vocab}") if limits.vocab
                  else _integer(0, INDEX_MAX)),
        "repetition_penalty": _number(0), "presence_penalty": _number(), "frequency_penalty": _number(),
        "repetition_context_size": window, "presence_context_size": window, "frequency_context_size": window,
        "xtc_probability": _number(0, 1), "xtc_threshold": _number(0, 1),
        "num_draft_tokens": _integer(0, INDEX_MAX), "seed": _integer(0, SEED_MAX),
        "logit_bias": _logit_bias(limits.vocab), "stop": _stops,
        "chat_template_kwargs": _template_kwargs(limits.template_parameters),
        "tools": _list_of_objects, "role_mapping": _role_mapping,
    }


def check_completion(body: dict, kind: str, limits: RequestLimits) -> dict:
    """The body of a chat ("chat") or text ("text") completion as mlx_lm.server is to see it: every field it
    reads checked, null fields left out, `stop` a list and `max_tokens` set; or RequestRefused."""
    checked = dict(body)
    for name, check in _fields(limits).items():
        if checked.get(name) is None:
            checked.pop(name, None)
        else:
            checked[name] = check(name, checked[name])
    checked["max_tokens"] = _max_tokens(checked, limits)
    if kind == "chat":
        _messages(checked.get("messages"), limits.images)
    elif not isinstance(checked.get("prompt"), str) or not checked["prompt"]:
        _refuse("prompt", "a non-empty string")
    return checked


def _max_tokens(body: dict, limits: RequestLimits) -> int:
    """The request's max_tokens (mlx_lm.server takes max_completion_tokens first), within the limits."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.pop(name, None)
        if value is not None:
            return _integer(1, limits.max_tokens, limits.max_tokens_bound)(name, value)
    return limits.default_max_tokens


def _messages(messages, images: bool) -> None:
    if not isinstance(messages, list) or not messages:
        _refuse("messages", "a non-empty list of {\"role\", \"content\"}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            _refuse(f"messages.{i}", "an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                _content_part(f"messages.{i}.content.{j}", part, images)
        elif content is not None and not isinstance(content, str):
            _refuse(f"messages.{i}.content", "a string or a list of content parts")
        if message.get("tool_calls") is not None:
            _list_of_objects(f"messages.{i}.tool_calls", message["tool_calls"])


def _content_part(name: str, part, images: bool) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        _string(f"{name}.text", part.get("text"))
    elif kind in _IMAGE_PARTS and images:
        url = part.get("image_url", part.get("image"))
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url.startswith("data:"):
            _refuse(name, "an image given as a data: URL (this server fetches nothing)")
    else:
        allowed = "text or an image" if images else "text (this model takes no images)"
        _refuse(name, f"a content part of {allowed}: {{\"type\": \"text\", \"text\": \"...\"}}")
