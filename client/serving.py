"""An OpenAI-compatible HTTP server over a streamed model: mlx_lm.server with only the model loading replaced.

mlx_lm.server keeps everything else: the request handling and validation, chat templates, the prompt cache,
sampling, and its generation thread, which batches concurrent requests through one forward (BatchGenerator)
and is the only thread that runs the model, so the StreamedLM is never used from two threads. The seam is
`ModelProvider._load`, which mlx_lm.server calls from that thread: `StreamedModelProvider` loads a StreamedLM
there instead of the whole model (docs/architecture.md, "moe-l2 serve").
"""

from __future__ import annotations

import functools
import json
import logging
import re
import signal
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, _run_http_server

from moe_l2.client import messages
from moe_l2.client.distributed import speaks_for_daemon
from moe_l2.client.messages import MessagesRoute
from moe_l2.client.streamed_lm import StreamedLM
from moe_l2.client.options import StreamOptions
from moe_l2.client.serving_metrics import CONTENT_TYPE_LATEST, ServingMetrics, endpoint_of

__all__ = ["StreamedModelProvider", "HintingResponseGenerator", "StreamedAPIHandler", "ObservedGenerator",
           "RequestRefused", "openai_error", "serve", "prompt_text"]

log = logging.getLogger("moe-l2.serve")


class RequestRefused(ValueError):
    """A request this server does not serve: the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class StreamedModelProvider(ModelProvider):
    """mlx_lm.server's ModelProvider for the one model this server streams.

    `cli_args` carries mlx_lm.server's option names; `options` how the experts are streamed (client/options.py);
    `group` the mlx.distributed group of a pipeline (None: the whole model in this process). The model answers
    to its resolved path (what GET /v1/models lists), to the `--model` text as given and to mlx-lm's
    "default_model"."""

    def __init__(self, cli_args, model_dir: Path, given: str, options: StreamOptions,
                 group: mx.distributed.Group | None = None):
        self.model_id = str(Path(model_dir).resolve())
        cli_args.model = self.model_id
        super().__init__(cli_args)
        self._model_map[given] = self.model_id
        self._options = options
        self._group = group
        self.rank = 0 if group is None else group.rank()
        self.speaks = True  # whether this rank sends the hints to its daemon (docs/distributed.md)
        self.lm: StreamedLM | None = None
        self.load_error: Exception | None = None
        self.loaded = threading.Event()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path != self.model_id:
            raise RequestRefused(f"this server serves {self.model_id} only: ask for that model (GET /v1/models), "
                                 f"or for 'default_model'; start another moe-l2 serve for {model_path}",
                                 404, "model", "model_not_found")
        if adapter_path is not None or draft_model_path is not None:
            raise RequestRefused("moe-l2 serve runs no adapters and no draft models: leave 'adapters' and "
                                 "'draft_model' out of the request", 400,
                                 "adapters" if adapter_path is not None else "draft_model")
        if self.lm is None:
            self.lm = StreamedLM(self.model_id, self._options, tokenizer_config=self._tokenizer_config,
                                 group=self._group)
            if self._group is not None:  # a collective: every rank loads here, on its generation thread
                self.speaks = speaks_for_daemon(self._group, self.lm.client.address if self.lm.client else None)
        tokenizer = self.lm.tokenizer
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            self._use_default_chat_template(tokenizer)
        self.model_key = (model_path, None, None)
        self.model = self.lm.model
        self.tokenizer = tokenizer
        self.processor = load_processor(self.lm.model, self.lm.config)
        self.draft_model = None
        # The same test as mlx_lm.server: batched generation needs caches that can merge.
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(self.lm.model))

    def _use_default_chat_template(self, tokenizer) -> None:
        """mlx_lm.server's --use-default-chat-template: the tokenizer's default template where it has none of its
        own. transformers dropped `default_chat_template` (4.43), where mlx_lm.server's load then fails with an
        AttributeError; here the model's chats then go as they would without the flag, in mlx_lm.server's plain
        role format (convert_chat), and the log says so."""
        default = getattr(tokenizer, "default_chat_template", None)  # TokenizerWrapper delegates to transformers'
        if default is not None:
            tokenizer.chat_template = default
            return
        import transformers

        log.warning("--use-default-chat-template: %s has no chat template and transformers %s has no default one; "
                    "chats are sent in mlx_lm.server's plain role format: give a template with --chat-template",
                    self.model_id, transformers.__version__)

    def load_default(self):
        """Called first thing by the generation thread: the load's error goes to serve(), which says it and
        exits, instead of killing the thread behind a server that answers /health."""
        try:
            super().load_default()
        except Exception as exc:  # anything StreamedLM raises is the user's to read, not a traceback
            self.load_error = exc
        finally:
            self.loaded.set()

    def hint(self, text: str) -> None:
        """Tell the daemon what a request is about (a queue put: the daemon may preload its domain)."""
        lm = self.lm
        if text and self.speaks and lm is not None and lm.client is not None:
            lm.client.hint(text)

    def close(self) -> None:
        if self.lm is not None:
            self.lm.close()
            self.lm = None


def prompt_text(request) -> str:
    """The words a request is about: a completion's prompt, or a chat's last user message."""
    if request.request_type == "text":
        return request.prompt if isinstance(request.prompt, str) else ""
    for message in reversed(request.messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content if isinstance(content, str) else ""
    return ""


class HintingResponseGenerator(ResponseGenerator):
    """mlx_lm.server's ResponseGenerator that hints the daemon as its generation thread takes each request,
    before its prefill. There every rank of a pipeline sees the request (mlx_lm.server shares it from rank 0,
    whose HTTP thread alone received it), so every host's daemon gets the hint."""

    def _share_request(self, request):
        shared = super()._share_request(request)
        if shared is not None:
            self.model_provider.hint(prompt_text(shared[1]))
        return shared


# mlx_lm.server's validation names the handler's attribute ("requested_model must be of type str"): the field.
_FIELDS = {"requested_model": "model", "requested_draft_model": "draft_model", "adapter": "adapters"}
_VALIDATION = re.compile(r"^(\w+) must ")
_ROUTES = ("POST /v1/chat/completions, /v1/completions and /v1/messages; GET /v1/models, /health and /metrics")


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, which the openai client shows the message of."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ObservedGenerator:
    """The response generator as one request's handler sees it: mlx_lm.server's, with what its `generate` gave
    kept for the handler (the request's context, its tokens, the error it raised) and counted in the server's
    metrics. Every other attribute is the generator's."""

    def __init__(self, generator: ResponseGenerator, metrics: ServingMetrics):
        self.generator = generator
        self.metrics = metrics
        self.context = None
        self.tokens: list[int] = []
        self.error: Exception | None = None

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def generate(self, request, generation_args, progress_callback=None):
        asked = time.monotonic()
        try:
            self.context, responses = self.generator.generate(request, generation_args, progress_callback)
        except Exception as exc:
            self.error = exc
            raise
        self.metrics.prompt_tokens.inc(len(self.context.prompt))
        return self.context, self._follow(responses, asked)

    def _follow(self, responses, asked: float):
        first = last = None
        try:
            for response in responses:
                last = time.monotonic()
                first = first or last
                self.tokens.append(response.token)
                self.metrics.generated_tokens.inc()
                yield response
        finally:
            if first is not None:
                self.metrics.first_token_seconds.inc(first - asked)
                self.metrics.generation_seconds.inc(last - first)


class _ErrorBody:
    """Stands in for the handler's wfile between mlx_lm.server's error status and the body it writes next
    (`{"error": "<text>"}`, or `Not Found`): the handler answers in its API's error shape instead."""

    def __init__(self, handler: "StreamedAPIHandler", status: int):
        self.handler = handler
        self.status = status

    def write(self, data: bytes) -> int:
        try:
            text = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            text = data.decode(errors="replace")
        self.handler.answer_error(self.status, str(text))
        return len(data)

    def flush(self) -> None:
        pass


class StreamedAPIHandler(MessagesRoute, APIHandler):
    """mlx_lm.server's handler, with:
    - GET /v1/models listing the one model served (mlx_lm.server would also list the Hugging Face cache, which
      this server cannot serve), and every reply naming that model, whatever name the request used;
    - errors as OpenAI's error object (Anthropic's on /v1/messages) with the status that fits: mlx_lm.server
      writes `{"error": "<text>"}` (404 for anything its generation raised); the handler withholds that and
      answers from the exception and the text;
    - POST /v1/messages, Anthropic's Messages API (client/messages.py), and GET /metrics
      (client/serving_metrics.py).
    One handler answers one request (HTTP/1.0, as mlx_lm.server's)."""

    def __init__(self, response_generator, *args, metrics: ServingMetrics, **kwargs):
        self.metrics = metrics
        self.observed = ObservedGenerator(response_generator, metrics)
        self.endpoint = "other"
        self.error_body = openai_error
        self.withheld = False  # mlx_lm.server's headers are not sent: this handler writes the reply itself
        self.started = False   # some byte of the reply is out
        self.status = 0        # of the reply begun
        super().__init__(self.observed, *args, **kwargs)

    @property
    def model_id(self) -> str:
        return self.observed.model_provider.model_id

    def setup(self) -> None:
        super().setup()
        self.raw_wfile = self.wfile

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            self.endpoint = endpoint_of(self.path)
        return parsed

    def do_GET(self):
        if self.endpoint == "/metrics":
            self.send_body(200, CONTENT_TYPE_LATEST, self.metrics.page())
        else:
            super().do_GET()

    def do_POST(self):
        with self.metrics.in_flight.track_inprogress():
            try:
                if self.path.startswith(messages.PATH):
                    self.error_body = messages.error_body
                if self.path == messages.PATH:
                    self.post_messages()
                else:
                    super().do_POST()
            except Exception as exc:
                if self.started:
                    raise  # the reply is under way: the connection closes, as mlx_lm.server leaves it
                log.exception("%s failed", self.endpoint)
                self.answer_error(500, f"the generation failed: {exc}")

    def handle_models_request(self):
        body = {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created}]}
        self.send_body(200, "application/json", json.dumps(body).encode())

    def generate_response(self, *args, **kwargs) -> dict:
        return {**super().generate_response(*args, **kwargs), "model": self.model_id}

    def completion_usage_response(self, *args, **kwargs) -> dict:
        return {**super().completion_usage_response(*args, **kwargs), "model": self.model_id}

    # The reply's headers and body.

    def send_response(self, code, message=None):
        super().send_response(code, message)
        self.status = code

    def _set_completion_headers(self, status_code: int = 200):
        if status_code < 400:
            super()._set_completion_headers(status_code)
            return
        self.withheld = True
        self.wfile = _ErrorBody(self, status_code)

    def _set_stream_headers(self, status_code: int = 200):
        if self.messages_request is not None:
            self.start_messages_reply()
            self.withheld = True
        else:
            super()._set_stream_headers(status_code)

    def end_headers(self):
        if not self.withheld:
            super().end_headers()
            self.started = True
            self.metrics.requests.labels(self.endpoint, str(self.status)).inc()

    def send_body(self, status: int, content_type: str, body: bytes) -> None:
        self.wfile = self.raw_wfile
        self.withheld = False
        self._headers_buffer = []  # a 200 mlx_lm.server began before the generation failed
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def send_json(self, status: int, body: dict) -> None:
        self.send_body(status, "application/json", json.dumps(body).encode())

    def answer_error(self, status: int, message: str, param: str | None = None) -> None:
        """An error reply; `status` and `message` as mlx_lm.server (or this handler) would give them, made
        precise from what generate() raised: a refusal of the provider's carries its status and fields, the
        generation thread's death is the server's error, anything else the request's."""
        code = None
        exc = self.observed.error
        if isinstance(exc, RequestRefused):
            status, param, code = exc.status, exc.param, exc.code
        elif exc is not None:
            status = 500 if isinstance(exc, RuntimeError) else 400
        elif status == 404:
            message = f"{self.command} {self.path}: no such endpoint; this server answers {_ROUTES}"
        elif param is None and (match := _VALIDATION.match(message)):
            param = _FIELDS.get(match.group(1), match.group(1))
        self.send_json(status, self.error_body(status, message, param, code))


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # mlx_lm.server shuts down on KeyboardInterrupt: SIGTERM does the same


def _follow(generator: HintingResponseGenerator) -> None:
    """A rank other than 0: run rank 0's requests until SIGTERM or SIGINT (or until rank 0 goes away and the
    generation thread's collective fails)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        generator.join()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(host: str, port: int, provider: StreamedModelProvider, on_ready=None, on_close=None) -> None:
    """Load the model on mlx_lm.server's generation thread, then serve HTTP until SIGINT or SIGTERM.

    Raises the load's error (before anything listens) if the model cannot be loaded. `on_ready(provider)` runs
    once the model is loaded, before the first request is accepted; `on_close(provider)` after the last, before
    the model's stream is closed. Under mlx.launch, only rank 0 listens; the
    other ranks run their pipeline stage for every request rank 0 shares, until they are stopped."""
    generator = HintingResponseGenerator(provider, LRUPromptCache(provider.cli_args.prompt_cache_size))
    try:
        provider.loaded.wait()
        if provider.load_error is not None:
            raise provider.load_error
        if on_ready is not None:
            on_ready(provider)
        if provider.rank != 0:
            _follow(generator)
            return
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            handler = functools.partial(StreamedAPIHandler, metrics=ServingMetrics(provider, generator))
            _run_http_server(host, port, generator, handler_class=handler)
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        # A follower's generation thread may wait in a collective for a rank 0 that is gone: it is left to the
        # process' exit, as mlx_lm.server leaves it.
        if provider.rank == 0:
            generator.stop_and_join()
        if on_close is not None and provider.lm is not None:
            on_close(provider)
        provider.close()
