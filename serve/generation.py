"""`moe-l2 serve`'s generation: mlx_lm.server's ResponseGenerator with what moe-l2 does on its generation thread,
and one request's generation as its HTTP handler sees it (docs/architecture.md, "moe-l2 serve").

On the generation thread (`ServedResponseGenerator`): each request's prompt goes to the daemon as a hint; its
tokens are checked against the model's context (an empty prompt, which kills mlx-lm's batch, is refused, and
max_tokens ends where the context does); the thread's work for each request is counted as it does it (the tokens it
generates, the requests it holds), so /metrics shows that a cancelled request's generation stopped; and if the
thread dies anyway the process exits non-zero, so that a supervisor restarts it, instead of answering 500 forever.

On the handler's side (`ObservedGenerator`): the request's context, tokens and timing for the metrics, and the
client's hang-up, looked for at every token and every prefill step: a request whose client is gone raises
`ClientGone`, and mlx_lm.server's handler then stops its generation (`GenerationContext.stop`). mlx_lm.server
notices a hang-up only when a write to the connection fails, which a reply that is not streamed never makes
before its end.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from mlx_lm.server import GenerationContext, Response, ResponseGenerator

from moe_l2.serve.checks import RequestRefused

__all__ = ["ServedResponseGenerator", "ObservedGenerator", "ClientGone", "GenerationThreadDied", "hung_up",
           "prompt_text"]

log = logging.getLogger("moe-l2.serve")


class ClientGone(ConnectionError):
    """The client closed its connection before its reply was complete."""


class GenerationThreadDied(RuntimeError):
    """mlx_lm.server's generation thread raised (mlx-lm logged the traceback): the server cannot generate."""


def hung_up(connection: socket.socket) -> bool:
    """Whether the client has closed its end of the connection. An HTTP/1.0 client sends nothing after its body,
    so a connection with bytes to read is open and one at its end (or reset) is closed; a client that shuts
    down only its sending side counts as gone. The handler's socket is blocking (no timeout), so MSG_DONTWAIT
    alone keeps this from waiting."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


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


class _HeldRequest:
    """A request the generation thread holds, in place of its response queue: what the thread puts is passed
    on to the handler's queue and counted."""

    def __init__(self, queue, generator: "ServedResponseGenerator"):
        self.queue = queue
        self.generator = generator
        self.context: GenerationContext | None = None

    def put(self, item) -> None:
        generator = self.generator
        if isinstance(item, GenerationContext):
            self.context = item
        elif isinstance(item, Response):
            generator.generated_tokens += 1
        if item is None or isinstance(item, Exception):
            generator.held.discard(self)  # finished, or refused
        elif self.context is not None and self.context._should_stop:
            # mlx_lm.server reads the flag right after this put and removes the request from its batch before
            # it takes the next one from the queue (ServedResponseGenerator._share_request)
            generator.stopping.add(self)
        self.queue.put(item)


class ServedResponseGenerator(ResponseGenerator):
    """mlx_lm.server's ResponseGenerator, with moe-l2's work on its generation thread (the module's docstring).
    `generated_tokens` and `held` are read by /metrics; only the generation thread changes them."""

    def __init__(self, model_provider, prompt_cache):
        self.generated_tokens = 0
        self.held: set[_HeldRequest] = set()
        self.stopping: set[_HeldRequest] = set()
        self.died = False
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def _share_request(self, request):
        """Called by the generation thread each time it looks for a request (every rank of a pipeline sees the
        request here, so every host's daemon gets the hint)."""
        self.held -= self.stopping  # removed from the batch since the last call
        self.stopping.clear()
        shared = super()._share_request(request)
        if shared is None:
            return None
        self.model_provider.hint(prompt_text(shared[1]))
        held = _HeldRequest(shared[0], self)
        self.held.add(held)
        return held, *shared[1:]

    def _tokenize(self, tokenizer, request, args):
        """mlx_lm.server's tokenization, where the prompt's length is first known: an empty prompt is refused
        (mlx-lm's batch raises on it, on the generation thread), so is one that fills the context, and
        max_tokens ends where the context does. mlx_lm.server answers what this raises to the request alone."""
        tokenized = super()._tokenize(tokenizer, request, args)
        prompt, context = tokenized[0], self.model_provider.context
        if not isinstance(prompt, list) or not prompt:
            raise RequestRefused("the prompt is empty once tokenized: send some text")
        if context is not None:
            if len(prompt) >= context:
                raise RequestRefused(f"the prompt is {len(prompt)} tokens and the model's context {context}: "
                                     "shorten it", param="messages" if request.request_type == "chat" else "prompt")
            args.max_tokens = min(args.max_tokens, context - len(prompt))
        return tokenized

    def _run_generate(self):
        super()._run_generate()  # mlx-lm logs what killed the thread
        if self._generation_failed:
            self.died = True
            # The main thread stops serving as on SIGTERM (serve/server.py), then exits non-zero.
            os.kill(os.getpid(), signal.SIGTERM)


class ObservedGenerator:
    """The response generator as one request's handler sees it: mlx_lm.server's, with what its `generate` gave
    kept for the handler (the request's context, its tokens, the error it raised), its timing counted in the
    server's metrics, and the client's hang-up raised as ClientGone. Every other attribute is the generator's."""

    def __init__(self, generator: ServedResponseGenerator, metrics, gone):
        self.generator = generator
        self.metrics = metrics
        self.gone = gone  # () -> whether the client hung up
        self.context = None
        self.tokens: list[int] = []
        self.error: Exception | None = None

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def generate(self, request, generation_args, progress_callback=None):
        asked = time.monotonic()

        def progress(processed: int, total: int) -> None:
            self._check_client()
            if progress_callback is not None:
                progress_callback(processed, total)

        try:
            self.context, responses = self.generator.generate(request, generation_args, progress)
        except Exception as exc:
            self.error = exc
            raise
        self.metrics.prompt_tokens.inc(len(self.context.prompt))
        return self.context, self._follow(responses, asked)

    def _check_client(self) -> None:
        if self.gone():
            raise ClientGone("the client hung up")

    def _follow(self, responses, asked: float):
        first = last = None
        try:
            for response in responses:
                self._check_client()
                last = time.monotonic()
                first = first or last
                self.tokens.append(response.token)
                yield response
        finally:
            if first is not None:
                self.metrics.first_token_seconds.inc(first - asked)
                self.metrics.generation_seconds.inc(last - first)
