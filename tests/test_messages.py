"""Anthropic's Messages API on `moe-l2 serve` (serve/messages.py), through the official anthropic client and raw
HTTP, against the chat completions of the same server process: the same text and token counts at temperature 0,
streamed or not, its stop reasons, and its errors as Anthropic's error object."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import openai
import pytest

from .conftest import ServeProcess

PROMPTS = ["Which experts does the router pick?", "Tell me about shared memory caches.",
           "one two three four five six seven eight nine ten", "Why?"]
MAX_TOKENS = 12
SYSTEM = "You answer in one line."


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = ServeProcess.moe_l2(model_dir, tmp_path_factory.mktemp("messages") / "serve.log", "--no-daemon")
    server.wait_healthy()
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model_dir)


def _anthropic(server: ServeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _chat(server: ServeProcess, prompt: str, system: str | None = None, **extra) -> openai.types.chat.ChatCompletion:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return server.client().chat.completions.create(model="default_model", messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, **extra)


def _asked(prompt: str, system=None, **extra) -> dict:
    return dict(model="default_model", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}],
                extra_body={"temperature": 0.0}, **({"system": system} if system else {}), **extra)


@pytest.mark.parametrize("prompt, system", [
    (PROMPTS[0], None), (PROMPTS[1], SYSTEM),
    (PROMPTS[1], [{"type": "text", "text": "You answer "}, {"type": "text", "text": "in one line."}])])
def test_the_anthropic_client_gets_the_chat_completions_text_and_usage(server, model_dir, prompt, system):
    client = _anthropic(server)
    chat = _chat(server, prompt, SYSTEM if system else None)
    reply = client.messages.create(**_asked(prompt, system))
    assert [(b.type, b.text) for b in reply.content] == [("text", chat.choices[0].message.content)]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                      chat.usage.completion_tokens)
    assert reply.stop_reason == "max_tokens" and chat.choices[0].finish_reason == "length"
    assert (reply.model, reply.role, reply.type) == (str(model_dir.resolve()), "assistant", "message")
    assert reply.id.startswith("msg_")
    with client.messages.stream(**_asked(prompt, system)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == chat.choices[0].message.content == final.content[0].text
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.output_tokens == chat.usage.completion_tokens
    assert final.stop_reason == "max_tokens" and final.id != reply.id


def _a_stop_word(server: ServeProcess, tokenizer) -> tuple[str, str, int]:
    """A prompt, and a word its reply has as its k-th token (k >= 2) and not before: a token of its own, as
    mlx-lm matches stop words as the tokens they encode to."""
    for prompt in PROMPTS:
        status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                            "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                            "logprobs": True})
        tokens = [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]
        for k in range(2, len(tokens)):
            word = tokenizer.decode([tokens[k]])
            if tokens[k] not in tokens[:k] and tokenizer.encode(word, add_special_tokens=False) == [tokens[k]]:
                return prompt, word, k
    raise AssertionError("no reply has a word to stop at")


def test_a_stop_sequence_ends_the_reply_and_is_named(server, tokenizer):
    prompt, word, k = _a_stop_word(server, tokenizer)
    chat = _chat(server, prompt, stop=[word, "never said"])
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == k + 1
    client = _anthropic(server)
    reply = client.messages.create(**_asked(prompt, stop_sequences=["never said", word]))
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", word)
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.output_tokens == k + 1
    with client.messages.stream(**_asked(prompt, stop_sequences=[word])) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", word,
                                                                              reply.content[0].text)


def test_stop_reasons_of_mlx_lm_finishes(tokenizer):
    from moe_l2.serve.messages import stop_reason

    eos = next(iter(tokenizer.eos_token_ids))
    word = tokenizer.encode(" the", add_special_tokens=False)
    assert stop_reason("length", [5, 6], tokenizer, (" the",)) == ("max_tokens", None)
    assert stop_reason("stop", [5, eos], tokenizer, (" the",)) == ("end_turn", None)
    assert stop_reason("stop", [5, *word], tokenizer, ("x", " the")) == ("stop_sequence", " the")
    assert stop_reason("stop", [5, *word], tokenizer, ()) == ("end_turn", None)


def test_raw_server_sent_events_are_anthropics(server):
    body = {"max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": PROMPTS[3]}]}
    request = urllib.request.Request(f"{server.url}/v1/messages", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        raw = r.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == name[len("event: "):]
    names = [e["type"] for e in events if e["type"] != "ping"]  # pings while the prompt is processed
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas > 0
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 3
    assert events[0]["message"]["usage"]["input_tokens"] == events[-2]["usage"]["input_tokens"] > 0


def test_messages_count_in_the_metrics(server):
    before = server.metrics()
    reply = _anthropic(server).messages.create(**_asked(PROMPTS[2]))
    after = server.metrics()
    key = ("moe_l2_serve_requests_total", (("endpoint", "/v1/messages"), ("status", "200")))
    assert after[key] - before.get(key, 0) == 1
    tokens = ("moe_l2_serve_generated_tokens_total", ())
    assert after[tokens] - before[tokens] == reply.usage.output_tokens


def test_errors_are_anthropic_error_objects(server, model_dir):
    with pytest.raises(anthropic.NotFoundError) as raised:
        _anthropic(server).messages.create(model="claude-something", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    assert f"this server serves {model_dir.resolve()} only" in str(raised.value)
    assert raised.value.body["error"]["type"] == "not_found_error"

    def error(body, path="/v1/messages") -> tuple[int, dict]:
        status, reply = server.post(path, body)
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
        return status, reply["error"]

    hi = [{"role": "user", "content": "hi"}]
    for body, message in (
            ({"messages": hi}, "max_tokens: Field required"),
            ({"messages": hi, "max_tokens": 0}, "max_tokens must be at least 1"),  # mlx_lm.server's validation
            ({"messages": hi, "max_tokens": 2, "temperature": -1}, "temperature must be at least 0"),
            ({"messages": [], "max_tokens": 2}, "messages must be a non-empty list"),
            ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}, "messages.0.role must be"),
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 2},
             "messages.0.content.0: moe-l2 serve takes text blocks only"),
            ({"messages": hi, "max_tokens": 2, "tools": [{"name": "x", "input_schema": {}}]}, "runs no tools"),
            ({"messages": hi, "max_tokens": 2, "stop_sequences": "."}, "stop_sequences must be a list"),
            ({"messages": hi, "max_tokens": 2, "stop_sequences": [""]}, "each of 1 to 1000 characters"),
            ([1, 2], "must be a JSON object"),
            # mlx_lm.server's own checks let these through, to kill its generation thread or run away
            ({"messages": hi, "max_tokens": 2**70}, "max_tokens must be at most 4096 (the model's context"),
            ({"messages": hi, "max_tokens": 2, "top_k": -1}, "top_k must be at least 0"),
            ({"messages": hi, "max_tokens": 2, "temperature": "hot"}, "temperature must be a finite number")):
        status, e = error(body)
        assert (status, e["type"]) == (400, "invalid_request_error") and message in e["message"], e
    # The body is read as on the other routes: a Content-Length of other digits than ASCII's was a 500.
    head = b"POST /v1/messages HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: "
    for length, status, message in ((b"\xc2\xb2", 400, "Content-Length must be the body's size in bytes"),
                                    (b"99999999999", 413, "this server takes at most")):
        got, reply = server.raw(head + length)
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
        assert got == status and message in reply["error"]["message"], reply
    got, reply = server.raw(head + b"3", b"{\xff}")
    assert (got, reply["error"]["type"]) == (400, "invalid_request_error") and "not UTF-8" in reply["error"]["message"]
    status, e = error({}, "/v1/messages/count_tokens")
    assert (status, e["type"]) == (404, "not_found_error") and "no such endpoint" in e["message"]
