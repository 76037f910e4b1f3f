"""An OpenAI-compatible HTTP server over a streamed model: mlx_lm.server with only the model loading replaced.

mlx_lm.server keeps everything else: the request handling and validation, chat templates, the prompt cache,
sampling, and its generation thread, which batches concurrent requests through one forward (BatchGenerator)
and is the only thread that runs the model, so the StreamedLM is never used from two threads. The seam is
`ModelProvider._load`, which mlx_lm.server calls from that thread: `StreamedModelProvider` loads a StreamedLM
there instead of the whole model (docs/architecture.md, "moe-l2 serve").
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, _run_http_server

from moe_l2.client.distributed import speaks_for_daemon
from moe_l2.client.mlx_lm import StreamedLM

__all__ = ["StreamedModelProvider", "HintingResponseGenerator", "StreamedAPIHandler", "serve", "prompt_text"]

log = logging.getLogger("moe-l2.serve")


class StreamedModelProvider(ModelProvider):
    """mlx_lm.server's ModelProvider for the one model this server streams.

    `cli_args` carries mlx_lm.server's option names; `lm_options` are StreamedLM's keyword arguments (L0 size,
    daemon socket or none, direct I/O, the mlx.distributed group of a pipeline). The model answers to its
    resolved path (what GET /v1/models lists), to the `--model` text as given and to mlx-lm's
    "default_model"."""

    def __init__(self, cli_args, model_dir: Path, given: str, lm_options: dict):
        self.model_id = str(Path(model_dir).resolve())
        cli_args.model = self.model_id
        super().__init__(cli_args)
        self._model_map[given] = self.model_id
        self._lm_options = lm_options
        group = lm_options.get("group")
        self.rank = 0 if group is None else group.rank()
        self.speaks = True  # whether this rank sends the hints to its daemon (docs/distributed.md)
        self.lm: StreamedLM | None = None
        self.load_error: Exception | None = None
        self.loaded = threading.Event()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path != self.model_id:
            raise ValueError(f"this server serves {self.model_id} only: ask for that model (GET /v1/models), or "
                             f"for 'default_model'; start another moe-l2 serve for {model_path}")
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("moe-l2 serve runs no adapters and no draft models: leave 'adapters' and "
                             "'draft_model' out of the request")
        if self.lm is None:
            self.lm = StreamedLM(self.model_id, tokenizer_config=self._tokenizer_config, **self._lm_options)
            group = self._lm_options.get("group")
            if group is not None:  # a collective: every rank loads here, on its generation thread
                self.speaks = speaks_for_daemon(group, self.lm.client.address if self.lm.client else None)
        tokenizer = self.lm.tokenizer
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model = self.lm.model
        self.tokenizer = tokenizer
        self.processor = load_processor(self.lm.model, self.lm.config)
        self.draft_model = None
        # The same test as mlx_lm.server: batched generation needs caches that can merge.
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(self.lm.model))

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


class StreamedAPIHandler(APIHandler):
    """mlx_lm.server's handler; GET /v1/models lists the one model served (mlx_lm.server would also list the
    Hugging Face cache, which this server cannot serve)."""

    def handle_models_request(self):
        model_id = self.response_generator.model_provider.model_id
        body = {"object": "list", "data": [{"id": model_id, "object": "model", "created": self.created}]}
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()


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


def serve(host: str, port: int, provider: StreamedModelProvider, on_ready=None) -> None:
    """Load the model on mlx_lm.server's generation thread, then serve HTTP until SIGINT or SIGTERM.

    Raises the load's error (before anything listens) if the model cannot be loaded. `on_ready(provider)` runs
    once the model is loaded, before the first request is accepted. Under mlx.launch, only rank 0 listens; the
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
            _run_http_server(host, port, generator, handler_class=StreamedAPIHandler)
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        # A follower's generation thread may wait in a collective for a rank 0 that is gone: it is left to the
        # process' exit, as mlx_lm.server leaves it.
        if provider.rank == 0:
            generator.stop_and_join()
        provider.close()
