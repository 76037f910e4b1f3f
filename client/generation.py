"""Generation with streamed experts through mlx-lm's own loop: the prompt as mlx-lm encodes it, and one run's
tokens, text and tier counts. Shared by `moe-l2 generate`, the demo, the benchmarks and the tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import stream_generate

from moe_l2.client.pool import TierCounts


def encode_prompt(tokenizer, text: str, chat_template: bool = True, *, system_prompt: str | None = None,
                  prefill_response: str | None = None, template_args: dict | None = None,
                  after_cache: bool = False) -> list[int]:
    """The prompt's token ids as mlx_lm.generate builds them: through the chat template when the tokenizer has
    one, after `system_prompt`, and continuing the assistant's `prefill_response`; `template_args` go to
    apply_chat_template. after_cache: the ids that follow a KV cache saved by mlx_lm.cache_prompt, which holds
    the template's text up to the user's message (mlx_lm.generate --prompt-cache-file)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": text})
        prefill = prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": prefill_response})
        template = {"continue_final_message": prefill, "add_generation_prompt": not prefill}
        if not after_cache:
            return list(tokenizer.apply_chat_template(messages, **template, **(template_args or {})))
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **template, **(template_args or {}))
        messages[-1]["content"] = "<query>"  # where the message starts, as mlx_lm.generate finds it
        start = tokenizer.apply_chat_template(messages, tokenize=False, **template).index("<query>")
        return list(tokenizer.encode(rendered[start:], add_special_tokens=False))
    return list(tokenizer.encode(text))


def generate_streamed(lm, prompt_ids: list[int], max_tokens: int, *, on_text=None, **generation) -> dict:
    """Generate with mlx-lm's own loop on a StreamedLM, `generation` being stream_generate's keyword arguments
    (sampler, max_kv_size, kv_bits...; by default greedy); returns the tokens, text and per-run numbers."""
    before = TierCounts()
    before.add(lm.pool.counts)
    prefetch_before = lm.pool.prefetch_counts
    stats_before = lm.stats.as_dict()
    tokens, text, last = [], [], None
    for response in stream_generate(lm.model, lm.tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                                    **generation):
        tokens.append(response.token)
        text.append(response.text)
        if on_text is not None and response.text:
            on_text(response.text)
        last = response
    counts = TierCounts()
    counts.add(lm.pool.counts)
    for name in counts.__dataclass_fields__:
        setattr(counts, name, getattr(counts, name) - getattr(before, name))
    stats = {k: v - stats_before[k] for k, v in lm.stats.as_dict().items()}
    return {"tokens": tokens, "text": "".join(text), "counts": counts, "stats": stats,
            "prefetch": lm.pool.prefetch_counts.minus(prefetch_before),
            "prompt_tokens": len(prompt_ids), "prompt_tps": last.prompt_tps if last else None,
            "generation_tokens": len(tokens), "generation_tps": last.generation_tps if last else None,
            "finish_reason": last.finish_reason if last else None}
