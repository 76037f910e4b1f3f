"""`moe-l2 serve` over real HTTP: raw requests and the openai package, against mlx_lm.server with the model
loaded whole (run as its own process, exactly as users start it), alone, concurrently, and two servers on one
real daemon that is killed and restarted under them; its error replies and its /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from moe_l2.cache.profile import Profile
from moe_l2.cache.trace import read_traces
from moe_l2.cli import main as moe_l2_main
from moe_l2.lab.daemon_process import short_tempdir
from moe_l2.runtime import default_socket

from .conftest import ServeProcess, budget_for, free_port, stats, synthetic_trace, wait_for

PROMPTS = ["Which experts does the router pick?", "Tell me about shared memory caches.",
           "one two three four five six seven eight nine ten", "Why?"]
MAX_TOKENS = 12
DEFAULT_MAX_TOKENS = 5  # the served fixture's --max-tokens
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
GENERATING, CANCELLED = ("moe_l2_serve_requests_generating", ()), ("moe_l2_serve_requests_cancelled_total", ())
GENERATED = ("moe_l2_serve_generated_tokens_total", ())


class Server(ServeProcess):
    """A server process, with the tokens of greedy chat and text completions."""

    def chat_tokens(self, prompt: str, model: str = "default_model", **extra) -> list[int]:
        status, body = self.post("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "logprobs": True, **extra})
        assert status == 200, body
        return [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]

    def text_tokens(self, prompt: str) -> list[int]:
        status, body = self.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0.0, "logprobs": True})
        assert status == 200, body
        return [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="module")
def reference(model_dir, logs):
    """mlx_lm.server with the model loaded whole: its tokens for every prompt, chat and completion."""
    server = Server.mlx_lm(model_dir, logs / "mlx_lm.log").wait_healthy()
    try:
        yield {"chat": [server.chat_tokens(p) for p in PROMPTS], "text": [server.text_tokens(p) for p in PROMPTS],
               "chat_text": [_openai_chat(server.client(), "default_model", p, stream=False) for p in PROMPTS]}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(model_dir, model_files, logs):
    """moe-l2 serve from the files with an L0 pool one expert more than a token needs: every batch of tokens
    evicts and refills rows, and batches of several sequences are run in chunks."""
    server = Server.moe_l2(model_dir, logs / "serve.log", "--no-daemon", "--l0-slots", str(model_files.top_k + 1),
                           "--max-tokens", str(DEFAULT_MAX_TOKENS))
    server.wait_healthy()
    yield server
    assert server.stop() == 0, server.log()  # SIGTERM is a clean shutdown
    # Its log ends with where the experts came from: without a daemon, the files read by the server itself.
    lookups = re.search(r"expert lookups since start: L0 \S+  L2 0\.0%  disk (\S+) \(read by moe-l2d while waiting "
                        r"0\.0%, by this process (\S+)\) of (\d+)", server.log())
    assert lookups and lookups[1] == lookups[2] != "0.0%" and int(lookups[3]) > 0, server.log()


def _openai_chat(client: openai.OpenAI, model: str, prompt: str, *, stream: bool) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                  temperature=0.0)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_greedy_tokens_equal_mlx_lm_servers_with_the_model_whole(served, reference):
    assert [served.chat_tokens(p) for p in PROMPTS] == reference["chat"]
    assert [served.text_tokens(p) for p in PROMPTS] == reference["text"]
    # A repeated request is served from mlx-lm's prompt cache: still the same tokens.
    assert served.chat_tokens(PROMPTS[0]) == reference["chat"][0]


def test_openai_client_streaming_and_not(served, reference, model_dir):
    client = served.client()
    models = client.models.list().data
    assert [m.id for m in models] == [str(model_dir.resolve())]
    for model in (models[0].id, "default_model", str(model_dir)):
        assert _openai_chat(client, model, PROMPTS[1], stream=False) == reference["chat_text"][1]
    for prompt, expected in zip(PROMPTS, reference["chat_text"]):
        assert _openai_chat(client, models[0].id, prompt, stream=True) == expected
    done = client.completions.create(model=models[0].id, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.0)
    streamed = client.completions.create(model=models[0].id, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                         temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert done.usage.completion_tokens == len(reference["text"][2])


def test_options_are_the_defaults_of_requests(served, reference):
    status, body = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}],
                                                        "logprobs": True})
    assert status == 200, body
    tokens = [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]
    assert tokens == reference["chat"][0][:DEFAULT_MAX_TOKENS]  # --max-tokens 5, and --temp 0: greedy


def test_raw_server_sent_events(served, reference):
    request = urllib.request.Request(f"{served.url}/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": PROMPTS[3]}],
                                                      "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                      "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = [line[len(b"data: "):] for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == reference["chat_text"][3]


def test_concurrent_requests_get_the_tokens_they_get_one_by_one(served, reference):
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        try:
            if i % 2:
                results[i] = _openai_chat(served.client(), "default_model", PROMPTS[i], stream=True)
            else:
                results[i] = served.chat_tokens(PROMPTS[i])
        except Exception as exc:  # reported below with the others' results
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    expected = {i: reference["chat_text"][i] if i % 2 else reference["chat"][i] for i in range(len(PROMPTS))}
    assert results == expected


def test_replies_name_the_served_model_whatever_the_request_called_it(served, model_dir):
    served_id = str(model_dir.resolve())
    for named in ({}, {"model": "default_model"}, {"model": str(model_dir)}):
        status, body = served.post("/v1/chat/completions", {**named, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and body["model"] == served_id, body
    status, body = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == served_id
    chunks = served.client().chat.completions.create(model="default_model", max_tokens=2, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}],
                                                     stream_options={"include_usage": True})
    assert {c.model for c in chunks} == {served_id}  # the text chunks and the usage chunk


def test_errors_are_openai_error_objects_the_client_shows(served, model_dir):
    with urllib.request.urlopen(f"{served.url}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    # The openai client puts the error object's message in the exception it raises.
    with pytest.raises(openai.NotFoundError) as raised:
        served.client().chat.completions.create(model="some/other-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
    helpful = f"this server serves {model_dir.resolve()} only"
    assert helpful in str(raised.value) and helpful in raised.value.message
    assert (raised.value.code, raised.value.param, raised.value.type) == ("model_not_found", "model",
                                                                          "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as raised:
        served.client().chat.completions.create(model="default_model", max_tokens=0,
                                                messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens must be at least 1" in str(raised.value) and raised.value.param == "max_tokens"

    def error(path: str, body: dict) -> tuple[int, dict]:
        status, reply = served.post(path, body)
        assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
        return status, reply["error"]

    status, e = error("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "draft_model": "some/draft"})
    assert (status, e["type"], e["param"]) == (400, "invalid_request_error", "draft_model")
    assert "no draft models" in e["message"]
    status, e = error("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert (status, e["param"]) == (400, "messages") and "this model takes no images" in e["message"]
    status, e = error("/v1/chat/completions", {"messages": [], "temperature": "hot"})
    assert (status, e["param"]) == (400, "temperature") and "temperature must be" in e["message"]
    status, e = error("/v1/embeddings", {"input": "hi"})
    assert status == 404 and "POST /v1/embeddings: no such endpoint" in e["message"] and "/v1/messages" in e["message"]
    request = urllib.request.Request(served.url + "/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 400 and "Invalid JSON" in json.loads(raised.value.read())["error"]["message"]


def _no_eos(model_dir) -> dict:
    """A logit_bias that keeps a generation from ending before its max_tokens."""
    from mlx_lm.utils import load_tokenizer

    return {str(eos): -100 for eos in load_tokenizer(model_dir).eos_token_ids}


def _bad_requests(vocab: int, context: int) -> list[tuple[str, dict, str, str]]:
    """(path, body, the field refused, what the refusal says). In mlx_lm.server, a logit_bias id past the
    vocabulary in a batch crashed the process (SIGSEGV in mlx); stop words that are not strings, an empty
    prompt, a context window past 32 bits or a sampled top_k of the vocabulary's size killed its generation
    thread; max_tokens ran away; a negative or 64-bit seed was a 500."""
    words = {"max_tokens": 2}
    return [
        (CHAT, {"messages": HI, **words, "logit_bias": {"99999999": 100}}, "logit_bias",
         f"token ids of this model (0 to {vocab - 1}), not '99999999'"),
        (CHAT, {"messages": HI, **words, "logit_bias": {"-1": 100}}, "logit_bias", "token ids of this model"),
        (CHAT, {"messages": HI, **words, "logit_bias": {"5": "much"}}, "logit_bias", "must be a finite number"),
        (CHAT, {"messages": HI, **words, "stop": 12345}, "stop", "stop must be a string or a list of at most 64"),
        (CHAT, {"messages": HI, **words, "stop": [1]}, "stop", "stop must be a string or a list"),
        (CHAT, {"messages": HI, **words, "stop": [""]}, "stop", "each of 1 to 1000 characters"),
        (TEXT, {"prompt": "", **words}, "prompt", "prompt must be a non-empty string"),
        (TEXT, {"prompt": "word " * context, **words}, "prompt", f"tokens and the model's context {context}"),
        (CHAT, {"messages": HI, "max_tokens": 2**70}, "max_tokens",
         f"max_tokens must be at most {context} (the model's context of {context} tokens)"),
        (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "must be at least 1"),
        (CHAT, {"messages": HI, "max_tokens": True}, "max_tokens", "max_tokens must be an integer"),
        (CHAT, {"messages": HI, **words, "seed": -1}, "seed", "seed must be at least 0"),
        (CHAT, {"messages": HI, **words, "seed": 2**70}, "seed", f"seed must be at most {2**64 - 1}"),
        (CHAT, {"messages": HI, **words, "repetition_penalty": 1.1, "repetition_context_size": 2**40},
         "repetition_context_size", f"at most {context} (the model's context)"),
        (CHAT, {"messages": HI, **words, "top_k": vocab, "temperature": 1.0}, "top_k",
         f"at most {vocab - 1} (below the model's vocabulary of {vocab})"),
        (CHAT, {"messages": HI, **words, "xtc_probability": 2}, "xtc_probability", "at most 1"),
        (CHAT, {"messages": HI, **words, "stream_options": {"include_usage": 1}}, "stream_options",
         "stream_options.include_usage must be true or false"),
        (CHAT, {"messages": HI, **words, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs",
         "not apply_chat_template's own arguments (tokenize)"),
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://198.51.100.1/a.png"}}]}], **words}, "messages",
         "this model takes no images"),
        (CHAT, {"messages": ["hi"], **words}, "messages", "messages.0 must be an object with a string role"),
    ]


def test_bad_requests_are_refused_before_mlx_lm_sees_them(served, reference, model_dir):
    """Every field mlx_lm.server reads is checked first, while a batch runs beside (an out-of-vocabulary
    logit_bias crashed the process only then): each bad request is a 400 naming its field, and the batch and
    the server go on."""
    config = json.loads((model_dir / "config.json").read_text())
    before = served.metrics()
    running = served.client().chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2000,
        temperature=0.0, stream=True, logit_bias=_no_eos(model_dir))
    next(running)  # its first token: the batch runs
    for path, body, param, says in _bad_requests(config["vocab_size"], config["max_position_embeddings"]):
        status, reply = served.post(path, body)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"}, reply
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), (body, reply)
        assert says in error["message"], (body, reply)
    assert next(running).choices  # the batch still runs
    running.close()  # and is cancelled (test_a_client_that_hangs_up_stops_its_generation)
    wait_for(lambda: (m := served.metrics())[GENERATING] == 0 and m[CANCELLED] == before[CANCELLED] + 1,
             what="the stream to be cancelled")
    assert served.chat_tokens(PROMPTS[1]) == reference["chat"][1]  # the generation thread serves on


def test_bodies_are_bounded_and_checked_before_they_are_read(served):
    """A body over --max-body-bytes is refused from its Content-Length before a byte of it is read (the test
    sends none; a 200 MB body took the server from 90 to 497 MiB); one that is not UTF-8 JSON or nests too
    deep is a 400 (they were 500s), and the log shows its first bytes only (mlx_lm.server logged all of it)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json"
    status, reply = served.raw(head + b"\r\nContent-Length: 209715200")
    assert status == 413 and f"at most {16 << 20} (its --max-body-bytes)" in reply["error"]["message"], reply
    status, reply = served.raw(head)
    assert status == 411 and "Content-Length header is required" in reply["error"]["message"]
    for body, says in ((b'{"messages": "\xff"}', "the body is not UTF-8 (byte 14)"),
                       (b"[" * 100_000, "too deeply nested"),
                       (b"[" * 65 + b"]" * 65, "nests arrays and objects more than 64 deep"),
                       (b'{"messages": [], "temperature": 1e400}', "temperature must be a finite number"),
                       (b'{"temperature": NaN}', "NaN is not a JSON number")):
        status, reply = served.raw(head + b"\r\nContent-Length: %d" % len(body), body)
        assert (status, reply["error"]["type"]) == (400, "invalid_request_error") and says in reply["error"]["message"]
    logged = len(served.log())
    junk = b"{" + b"x" * (1 << 20)
    status, reply = served.raw(head + b"\r\nContent-Length: %d" % len(junk), junk)
    assert status == 400 and "Invalid JSON in request body" in reply["error"]["message"]
    added = served.log()[logged:]
    assert "refused a body that is not JSON" in added and f"({len(junk)} bytes)" in added and len(added) < 2000


def test_a_client_that_hangs_up_stops_its_generation(served, model_dir):
    """A request whose client hangs up is cancelled when it is not streamed too (mlx_lm.server noticed a
    hang-up only when a write failed, which such a reply makes after its last token): the generation thread
    lets go of it and generates nothing more for it."""
    before = served.metrics()
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 4000,
                       "logit_bias": _no_eos(model_dir)}).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: served.metrics()[GENERATED] - before[GENERATED] >= 10, what="the generation")
    wait_for(lambda: (m := served.metrics())[GENERATING] == 0 and m[CANCELLED] == before[CANCELLED] + 1,
             what="the generation to be cancelled")
    stopped = served.metrics()[GENERATED]
    assert stopped - before[GENERATED] < 1000
    # Nothing more is generated for it: another request's tokens are all that the count moves by.
    status, reply = served.post(CHAT, {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 3})
    assert status == 200 and served.metrics()[GENERATED] - stopped == reply["usage"]["completion_tokens"] == 3


def test_limits_are_options_and_a_dying_generation_thread_ends_the_process(model_dir, logs, tmp_path):
    """--max-tokens-limit and --max-body-bytes bound requests. A fault on the generation thread (its model file
    truncated under it: the next expert read fails) killed mlx_lm.server's thread behind a process that went on
    answering 500 and /health 503; the process now exits with status 1, saying why, for a supervisor to restart."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    server = Server.moe_l2(copy, logs / "dies.log", "--no-daemon", "--max-tokens-limit", "64", "--max-tokens", "8",
                           "--max-body-bytes", "1KiB").wait_healthy()
    try:
        status, reply = server.post(CHAT, {"messages": HI, "max_tokens": 65})
        assert (status, reply["error"]["param"]) == (400, "max_tokens")
        assert "max_tokens must be at most 64 (this server's --max-tokens-limit 64)" in reply["error"]["message"]
        status, reply = server.raw(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1025")
        assert status == 413 and "the body is 1025 bytes; this server takes at most 1024" in reply["error"]["message"]
        for path in copy.glob("*.safetensors"):
            os.truncate(path, path.stat().st_size // 8)
        try:
            status, reply = server.post(CHAT, {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4})
            assert status == 500, reply  # if the request is answered before the process is gone
        except OSError:
            pass
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    assert "generation thread died" in server.log() and "for its supervisor to start it again" in server.log()


def _moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_what_a_request_did(served):
    before = served.metrics()
    status, body = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}],
                                                        "max_tokens": MAX_TOKENS, "temperature": 0.0})
    assert status == 200
    served.post("/v1/chat/completions", {"model": "some/other-model", "messages": HI})  # a 404
    after = served.metrics()
    usage = body["usage"]
    assert _moved(before, after, "moe_l2_serve_generated_tokens_total") == usage["completion_tokens"]
    assert _moved(before, after, "moe_l2_serve_prompt_tokens_total") == usage["prompt_tokens"]
    assert _moved(before, after, "moe_l2_serve_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert _moved(before, after, "moe_l2_serve_requests_total", endpoint="/v1/chat/completions", status="404") == 1
    assert _moved(before, after, "moe_l2_serve_requests_total", endpoint="/metrics", status="200") == 1
    assert _moved(before, after, "moe_l2_serve_generation_seconds_total") > 0
    assert _moved(before, after, "moe_l2_serve_first_token_seconds_total") > 0
    # Every token's forward looked experts up: from L0 or the files (no daemon), none from L2.
    tiers = {tier: _moved(before, after, "moe_l2_serve_expert_lookups_total", tier=tier)
             for tier in ("l0", "l2", "daemon_disk", "disk")}
    assert tiers["l0"] + tiers["disk"] > 0 and tiers["l2"] == tiers["daemon_disk"] == 0, tiers
    assert after[("moe_l2_serve_daemon_attached", ())] == 0
    # Each L0 pool's rows held now, within its ceiling (it grows on demand).
    held = {labels: v for (name, labels), v in after.items() if name == "moe_l2_serve_l0_rows"}
    ceiling = {labels: v for (name, labels), v in after.items() if name == "moe_l2_serve_l0_ceiling_rows"}
    assert held and held.keys() == ceiling.keys() and all(0 < held[k] <= ceiling[k] for k in held)
    assert after[("moe_l2_serve_requests_queued", ())] == 0
    wait_for(lambda: served.metrics()[("moe_l2_serve_requests_in_flight", ())] == 0, what="the requests to end")
    # Made-up paths do not grow the label set.
    served.post("/v1/made-up-path", {})
    assert _moved(after, served.metrics(), "moe_l2_serve_requests_total", endpoint="other", status="404") == 1


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be at least 1"),
    (["--max-tokens", "600", "--max-tokens-limit", "500"], "--max-tokens 600 is above --max-tokens-limit 500"),
    (["--max-body-bytes", "lots"], "--max-body-bytes: invalid size 'lots'"),
    (["--kv-bits", "7"], "--kv-bits must be"),
    (["--chat-template-args", "{oops"], "not JSON"),
    (["--chat-template-args", "[1]"], "give a JSON object"),
])
def test_bad_options_are_refused_before_listening(capsys, model_dir, args, message):
    argv = ["serve", "--model", str(model_dir), "--no-daemon", "--port", str(free_port()), *args]
    if args[0] == "--chat-template-args":  # refused by the parser
        with pytest.raises(SystemExit) as exit_:
            moe_l2_main(argv)
        assert exit_.value.code == 2
    else:
        assert moe_l2_main(argv) == 2
    assert message in capsys.readouterr().err


def test_start_up_errors_exit_with_the_reason(model_dir, model_files, logs):
    """A model this L0 size cannot run (status 2) and a port already taken (status 1), as the process exits."""
    small = Server.moe_l2(model_dir, logs / "small.log", "--no-daemon", "--l0-slots", str(model_files.top_k - 1))
    assert small.proc.wait(120) == 2
    assert f"L0 needs at least {model_files.top_k} slots per layer" in small.log()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = Server([sys.executable, "-P", "-m", "moe_l2.cli", "serve", "--model", str(model_dir), "--no-daemon"],
                      logs / "busy.log", port=port)
        assert busy.proc.wait(120) == 1
    # One line that names the option and what to do (said before the model is loaded).
    assert busy.log().splitlines() == [f"moe-l2 serve: --port {port} is in use on 127.0.0.1 (another server listens "
                                       "there): choose another --port, or stop that server"]
    assert "terminate called" not in small.log()


def test_a_directory_that_is_no_model_is_refused(capsys, tmp_path):
    assert moe_l2_main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no model directory at" in capsys.readouterr().err
    assert moe_l2_main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_two_servers_share_one_daemon_that_dies_and_comes_back(daemon_factory, model_dir, model_files, logs,
                                                                reference, capsys, tmp_path):
    # A profile whose domain "alpha" the daemon predicts from calculus words (conftest.synthetic_trace).
    trace = synthetic_trace(tmp_path / "toy.jsonl.gz", n_layers=model_files.n_layers,
                            n_experts=model_files.n_experts, top_k=model_files.top_k, seqs=6, tokens=40)
    Profile.from_traces(read_traces(trace)).save(tmp_path / "toy.json")
    runtime = short_tempdir()
    address = default_socket(runtime)
    budget = str(budget_for(model_files, model_files.n_experts))
    slots = str(model_files.top_k + 1)
    # The first server starts before any daemon: it serves from the files, then attaches when one starts.
    first = Server.moe_l2(model_dir, logs / "first.log", "--socket", address, "--l0-slots", slots).wait_healthy()
    second = None
    try:
        assert first.chat_tokens(PROMPTS[0]) == reference["chat"][0]
        daemon = daemon_factory([model_dir], budget, "--profile", str(tmp_path / "toy.json"), runtime_dir=runtime)
        second = Server.moe_l2(model_dir, logs / "second.log", "--socket", address, "--l0-slots", slots).wait_healthy()
        wait_for(lambda: stats(daemon)["daemon"]["clients"] == 2, what="both servers attached")
        for server in (first, second):
            assert [server.chat_tokens(p) for p in PROMPTS] == reference["chat"]
        wait_for(lambda: stats(daemon)["models"][0]["loads_in_flight"] == 0, what="loads")
        assert second.chat_tokens(PROMPTS[1]) == reference["chat"][1]
        l2 = stats(daemon)["models"][0]
        assert l2["hits"] > 0 and l2["loads_done"] > 0  # experts went through L2 to the servers
        scraped = second.metrics()  # and a server's /metrics says so
        assert scraped[("moe_l2_serve_expert_lookups_total", (("tier", "l2"),))] > 0
        assert scraped[("moe_l2_serve_daemon_attached", ())] == 1
        # Each request's prompt reaches the daemon as a hint.
        second.chat_tokens("what is the integral of this derivative")  # asserts a 200 answer
        wait_for(lambda: stats(daemon)["models"][0]["active_domain"] == "alpha", what="the hint")
        # A generate run shares the daemon with both servers.
        assert moe_l2_main(["generate", "--model", str(model_dir), "--socket", address, "--prompt", PROMPTS[3],
                            "--max-tokens", str(MAX_TOKENS), "--l0-slots", slots, "--json"]) == 0
        run = json.loads(capsys.readouterr().out)
        assert run["daemon"]["attached"] and run["l2_hits"] > 0 and run["tokens"] == reference["chat"][3]

        # kill -9 mid-request: the stream goes on from the files with the same tokens.
        chunks = first.client().chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True)
        text = [next(chunks).choices[0].delta.content or ""]
        daemon.kill9()
        text += [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(text) == reference["chat_text"][2]
        for server in (first, second):
            wait_for(lambda: "detached from moe-l2d" in server.log(), what="the servers to notice")
        for i, server in enumerate((first, second)):
            assert server.chat_tokens(PROMPTS[i]) == reference["chat"][i]

        # A new daemon on the same socket (it reclaims the killed one's segments): both re-attach.
        again = daemon_factory([model_dir], budget, runtime_dir=runtime)
        wait_for(lambda: stats(again)["daemon"]["clients"] == 2, what="both servers re-attached")
        for i, server in enumerate((first, second)):
            assert server.chat_tokens(PROMPTS[i + 2]) == reference["chat"][i + 2]
        # The servers read their misses and give them to the new daemon's L2 (fills), or it loads them.
        wait_for(lambda: (lambda m: m["loads_done"] + m["fills"]["donated"])(stats(again)["models"][0]) > 0,
                 what="records loaded into or given to the new daemon")
    finally:
        codes = [s.stop() for s in (first, second) if s is not None]
    assert codes == [0, 0]


def test_the_provider_loads_the_streamed_model_and_batches_exactly(model_dir, model_files):
    """In process: mlx_lm.server's seam gives the streamed model, its batched decode (several sequences per
    forward, in chunks through a small L0) gives each sequence's one-by-one tokens, and other models are refused."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, stream_generate

    from moe_l2.cli import build_parser
    from moe_l2.client.options import StreamOptions
    from moe_l2.serve.server import StreamedModelProvider
    from moe_l2.lm.switch import StreamedSwitch
    from moe_l2.cli.serve import mlx_lm_args

    args = build_parser("serve").parse_args(["serve", "--model", str(model_dir), "--no-daemon",
                                      "--chat-template", "{{ messages[0]['content'] }} =>"])
    provider = StreamedModelProvider(mlx_lm_args(args), model_dir, str(model_dir),
                                     StreamOptions(l0_slots=model_files.top_k + 1, daemon=False))
    try:
        model, tokenizer = provider.load("default_model")
        again = provider.load(str(model_dir.resolve()))
        assert again[0] is model and again[1] is tokenizer  # the same model, not a second one
        assert any(isinstance(m, StreamedSwitch) for _, m in model.named_modules())
        assert provider.is_batchable
        assert tokenizer.decode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])) == "hi =>"
        with pytest.raises(ValueError, match="serves .* only"):
            provider.load("another/model")

        prompts = [tokenizer.encode(p) for p in PROMPTS]
        one_by_one = [[r.token for r in stream_generate(model, tokenizer, mx.array(p), max_tokens=MAX_TOKENS)]
                      for p in prompts]
        batch = BatchGenerator(model, max_tokens=MAX_TOKENS)
        uids = batch.insert(prompts)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        finished: set[int] = set()
        while len(finished) < len(uids):
            for response in batch.next()[1]:
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    finished.add(response.uid)
        batch.close()
        assert [tokens[uid] for uid in uids] == one_by_one
        assert provider.lm.stats.chunked_calls > 0  # several sequences' experts did not fit L0 at once
    finally:
        provider.close()


def test_use_default_chat_template_on_a_model_without_one_loads_and_says_there_is_none(model_dir, tmp_path, caplog):
    """transformers has no `default_chat_template` any more (mlx_lm.server's load fails on one there): the model
    loads, the log says so, and chats go in mlx_lm.server's plain role format, as without the flag."""
    import shutil

    from mlx_lm.server import convert_chat

    from moe_l2.cli import build_parser
    from moe_l2.client.options import StreamOptions
    from moe_l2.serve.server import StreamedModelProvider
    from moe_l2.cli.serve import mlx_lm_args

    bare = tmp_path / "no-template"
    shutil.copytree(model_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    args = build_parser("serve").parse_args(["serve", "--model", str(bare), "--no-daemon",
                                             "--use-default-chat-template"])
    provider = StreamedModelProvider(mlx_lm_args(args), bare, str(bare), StreamOptions(l0_slots=4, daemon=False))
    try:
        with caplog.at_level("WARNING", logger="moe-l2.serve"):
            _, tokenizer = provider.load("default_model")
        assert tokenizer.chat_template is None and not tokenizer.has_chat_template
        assert any("has no default one" in r.getMessage() and "--chat-template" in r.getMessage()
                   for r in caplog.records)
        assert convert_chat([{"role": "user", "content": "hi"}], {}).strip()  # what mlx_lm.server sends then
    finally:
        provider.close()
