"""An OpenAI-compatible HTTP server over a streamed model: mlx_lm.server with only the model loading replaced.

mlx_lm.server keeps everything else: the request handling, chat templates, the prompt cache, sampling, and its
generation thread, which batches concurrent requests through one forward (BatchGenerator) and is the only thread
that runs the model, so the StreamedLM is never used from two threads. The seam is `ModelProvider._load`, which
mlx_lm.server calls from that thread: `StreamedModelProvider` loads a StreamedLM there instead of the whole
model. What this server adds around mlx_lm.server: every request checked before mlx_lm.server sees it
(serve/checks.py), the generation thread's work counted, a client's hang-up cancelling its generation
and the thread's death ending the process (serve/generation.py), and the handler's error replies
(docs/architecture.md, "moe-l2 serve").
"""

from __future__ import annotations

import functools
import io
import json
import logging
import signal
import threading
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import APIHandler, ModelProvider, _run_http_server

from moe_l2.serve import messages
from moe_l2.lm.distributed import speaks_for_daemon
from moe_l2.serve.messages import MessagesRoute
from moe_l2.client.options import StreamOptions
from moe_l2.serve.checks import RequestLimits, RequestRefused, check_completion, model_size, read_json
from moe_l2.serve.generation import (GenerationThreadDied, ObservedGenerator, ServedResponseGenerator,
                                              hung_up)
from moe_l2.serve.metrics import CONTENT_TYPE_LATEST, ServingMetrics, endpoint_of
from moe_l2.lm.streamed_lm import StreamedLM

__all__ = ["StreamedModelProvider", "StreamedAPIHandler", "openai_error", "serve"]

log = logging.getLogger("moe-l2.serve")


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
        self.context: int | None = None  # the model's context in tokens, and its vocabulary, if its config says
        self.vocab: int | None = None
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
        self.context = model_size(self.lm.config, "max_position_embeddings")
        self.vocab = model_size(self.lm.config, "vocab_size")
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


_ROUTES = ("POST /v1/chat/completions, /v1/completions and /v1/messages; GET /v1/models, /health and /metrics")
# What mlx_lm.server runs for each POST route: a chat or a text completion (/v1/messages as a chat).
_COMPLETIONS = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text",
                messages.PATH: "chat"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, which the openai client shows the message of."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
    - every POST checked before mlx_lm.server reads it (serve/checks.py), which then reads the checked
      body; a client that hangs up is not answered, and its generation stops (serve/generation.py);
    - errors as OpenAI's error object (Anthropic's on /v1/messages) with the status that fits: mlx_lm.server
      writes `{"error": "<text>"}` (404 for anything its generation raised); the handler withholds that and
      answers from the exception and the text;
    - POST /v1/messages, Anthropic's Messages API (serve/messages.py), and GET /metrics
      (serve/metrics.py).
    One handler answers one request (HTTP/1.0, as mlx_lm.server's)."""

    def __init__(self, response_generator, *args, metrics: ServingMetrics, limits: RequestLimits, **kwargs):
        self.metrics = metrics
        self.limits = limits
        self.observed = ObservedGenerator(response_generator, metrics, lambda: hung_up(self.connection))
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
                try:
                    self.post()
                except RequestRefused as exc:
                    self.refuse(exc)
            except ConnectionError:  # ClientGone, or a write to a connection the client closed
                self.close_connection = True
                self.metrics.cancelled.inc()
                log.info("%s: the client hung up before its reply was complete; its generation is stopped",
                         self.endpoint)
            except Exception as exc:
                if self.started:
                    raise  # the reply is under way: the connection closes, as mlx_lm.server leaves it
                log.exception("%s failed", self.endpoint)
                self.answer_error(500, f"the generation failed: {exc}")

    def post(self) -> None:
        """Check the request, then run it as mlx_lm.server's do_POST, with the checked body in place of the
        one sent; a path that is no route goes to mlx_lm.server unread (its 404)."""
        if self.path.startswith(messages.PATH):
            self.error_body = messages.error_body
        kind = _COMPLETIONS.get(self.path)
        if kind is None:
            super().do_POST()
            return
        body = read_json(self.headers, self.rfile, self.limits.body_bytes, self.endpoint)
        if self.path == messages.PATH:
            body = self.translate_messages(body)
        data = json.dumps(check_completion(body, kind, self.limits)).encode()
        self.rfile = io.BytesIO(data)
        self.headers.replace_header("Content-Length", str(len(data)))
        if self.messages_request is None:
            super().do_POST()
        else:
            self.run_messages(super().do_POST)

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

    def refuse(self, refusal: RequestRefused) -> None:
        self.send_json(refusal.status, self.error_body(refusal.status, str(refusal), refusal.param, refusal.code))

    def answer_error(self, status: int, message: str) -> None:
        """An error reply; `status` and `message` as mlx_lm.server (or this handler) would give them, made
        precise from what generate() raised: a refusal (the provider's, or of the prompt's tokens) carries its
        status and fields, the generation thread's death is the server's error, anything else the request's."""
        exc = self.observed.error
        if isinstance(exc, RequestRefused):
            self.refuse(exc)
            return
        if exc is not None:
            status = 500 if isinstance(exc, RuntimeError) else 400
        elif status == 404:
            message = f"{self.command} {self.path}: no such endpoint; this server answers {_ROUTES}"
        self.send_json(status, self.error_body(status, message))


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # mlx_lm.server shuts down on KeyboardInterrupt: SIGTERM does the same


def _follow(generator: ServedResponseGenerator) -> None:
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

    Raises the load's error (before anything listens) if the model cannot be loaded, and GenerationThreadDied
    once everything is shut down if the generation thread died. `on_ready(provider)` runs once the model is
    loaded, before the first request is accepted; `on_close(provider)` after the last, before the model's stream
    is closed. Under mlx.launch, only rank 0 listens; the other ranks run their pipeline stage for every request
    rank 0 shares, until they are stopped."""
    generator = ServedResponseGenerator(provider, LRUPromptCache(provider.cli_args.prompt_cache_size))
    try:
        provider.loaded.wait()
        if provider.load_error is not None:
            raise provider.load_error
        if on_ready is not None:
            on_ready(provider)
        if provider.rank != 0:
            _follow(generator)
        else:
            _listen(host, port, provider, generator)
    finally:
        # A follower's generation thread may wait in a collective for a rank 0 that is gone: it is left to the
        # process' exit, as mlx_lm.server leaves it.
        if provider.rank == 0:
            generator.stop_and_join()
        if on_close is not None and provider.lm is not None:
            on_close(provider)
        provider.close()
    if generator.died:
        raise GenerationThreadDied("the generation thread died (the traceback is above), so this server cannot "
                                   "generate: it stopped, for its supervisor to start it again")


def _listen(host: str, port: int, provider: StreamedModelProvider, generator: ServedResponseGenerator) -> None:
    """Rank 0: answer HTTP until SIGINT or SIGTERM (or the generation thread's death, which sends SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        handler = functools.partial(StreamedAPIHandler, metrics=ServingMetrics(provider, generator),
                                    limits=RequestLimits.of(provider))
        _run_http_server(host, port, generator, handler_class=handler)
    finally:
        signal.signal(signal.SIGTERM, previous)
