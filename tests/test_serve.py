"""`moe-l2 serve` over real HTTP: raw requests and the openai package, against mlx_lm.server with the model
loaded whole (run as its own process, exactly as users start it), alone, concurrently, and two servers on one
real daemon that is killed and restarted under them; its error replies and its /metrics."""

from __future__ import annotations

import json
import re
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
from moe_l2.daemon.process import short_tempdir
from moe_l2.runtime import default_socket

from .conftest import ServeProcess, budget_for, free_port, stats, synthetic_trace, wait_for

PROMPTS = ["Which experts does the router pick?", "Tell me about shared memory caches.",
           "one two three four five six seven eight nine ten", "Why?"]
MAX_TOKENS = 12
DEFAULT_MAX_TOKENS = 5  # the served fixture's --max-tokens


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
    assert status == 400 and "Only 'text' content" in e["message"]  # the chat template's refusal
    status, e = error("/v1/chat/completions", {"messages": [], "temperature": "hot"})
    assert (status, e["param"]) == (400, "temperature") and "temperature must be" in e["message"]
    status, e = error("/v1/embeddings", {"input": "hi"})
    assert status == 404 and "POST /v1/embeddings: no such endpoint" in e["message"] and "/v1/messages" in e["message"]
    request = urllib.request.Request(served.url + "/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert raised.value.code == 400 and "Invalid JSON" in json.loads(raised.value.read())["error"]["message"]


def _moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_what_a_request_did(served):
    before = served.metrics()
    status, body = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}],
                                                        "max_tokens": MAX_TOKENS, "temperature": 0.0})
    assert status == 200
    served.post("/v1/chat/completions", {"model": "some/other-model", "messages": []})  # a 404
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
        wait_for(lambda: stats(again)["models"][0]["loads_done"] > 0, what="loads into the new daemon")
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
    from moe_l2.client.serving import StreamedModelProvider
    from moe_l2.client.switch import StreamedSwitch
    from moe_l2.commands.serve import mlx_lm_args

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
    from moe_l2.client.serving import StreamedModelProvider
    from moe_l2.commands.serve import mlx_lm_args

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
