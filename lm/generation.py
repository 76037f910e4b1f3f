"""Generation with streamed experts through mlx-lm's own loop: the prompt as mlx-lm encodes it, one run's
tokens, text and tier counts (`Generation`), and the summary `moe-l2 generate` prints (`GenerationSummary`).
Shared by `moe-l2 generate`, the demo, the benchmarks and the tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import mlx.core as mx
from mlx_lm.generate import stream_generate

from moe_l2.client.pool import TierCounts
from moe_l2.client.prefetcher import PrefetchCounts
from moe_l2.tiers import source_shares


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


@dataclass(frozen=True)
class Generation:
    """One run of generate_streamed: its tokens and text, and what the stream did over it."""

    tokens: list[int]
    text: str
    counts: TierCounts        # this run's expert lookups, by tier
    stats: dict               # StreamStats over this run: calls, sync/fetch/copy/pread seconds
    prefetch: PrefetchCounts  # next-layer prefetch over this run
    prompt_tokens: int
    prompt_tps: float | None
    generation_tokens: int
    generation_tps: float | None
    finish_reason: str | None


def describe_l0(slots: int, layer_slots: list[int] | None) -> str:
    """An L0's ceiling in words: `slots` in all (a shared L0: no `layer_slots`), or per layer."""
    if layer_slots is None:
        return f"{slots} experts in all"
    low, high = min(layer_slots), max(layer_slots)
    return f"{slots} experts per layer" if low == high else f"{low}-{high} experts per layer (per-layer ceilings)"


def generate_streamed(lm, prompt_ids: list[int], max_tokens: int, *, on_text=None, **generation) -> Generation:
    """Generate with mlx-lm's own loop on a StreamedLM, `generation` being stream_generate's keyword arguments
    (sampler, max_kv_size, kv_bits...; by default greedy); returns the tokens, text and per-run numbers."""
    before = lm.pool.counts
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
    return Generation(tokens=tokens, text="".join(text), counts=lm.pool.counts.minus(before),
                      stats={k: v - stats_before[k] for k, v in lm.stats.as_dict().items()},
                      prefetch=lm.pool.prefetch_counts.minus(prefetch_before), prompt_tokens=len(prompt_ids),
                      prompt_tps=last.prompt_tps if last else None, generation_tokens=len(tokens),
                      generation_tps=last.generation_tps if last else None,
                      finish_reason=last.finish_reason if last else None)


@dataclass(frozen=True)
class StreamFigures:
    """What one process' expert stream did over a run: a pipeline rank's own part of the summary. Each lookup is
    counted once, by where its bytes came from (TierCounts.by_source)."""

    l0_hits: int
    l2_hits: int             # held in L2 when looked up
    daemon_reads: int        # read from disk by moe-l2d while the lookup waited (load-through)
    l3_reads: int            # read from disk by this process
    l2_lent: int             # computed on in place in L2, not copied
    read_bytes: int          # from the model files
    copied_bytes: int        # from L2
    l0_slots: int            # the ceiling, per layer (the largest layer's) or in all
    l0_layer_slots: list[int] | None  # each of `layers`' ceiling (per-layer L0s); None: a shared L0
    l0_rows: int             # held now, in all layers (fewer than the ceiling while L0 grows on demand)
    l0_bytes: int            # what l0_rows hold
    l0_ceiling_bytes: int
    layers: list[int]        # the MoE layers this process ran
    daemon: dict | None      # address, attached, attaches, last_error, link and waits (counts); None: no daemon
    streaming: dict          # StreamStats over the run
    prefetch: dict | None    # None: no next-layer prefetch
    peak_rss_bytes: int
    peak_mlx_bytes: int

    # Summed over a pipeline's ranks; the peaks are the largest rank's, the layers all ranks'.
    SUMMED = ("l0_hits", "l2_hits", "daemon_reads", "l3_reads", "l2_lent", "read_bytes", "copied_bytes", "l0_rows",
              "l0_bytes", "l0_ceiling_bytes")

    @classmethod
    def of(cls, run: Generation, lm) -> StreamFigures:
        from moe_l2.lm.streamed_lm import peak_rss_bytes

        c = run.counts
        tiers = c.by_source()
        client = lm.client
        return cls(l0_hits=tiers["l0"], l2_hits=tiers["l2"], daemon_reads=tiers["daemon_disk"],
                   l3_reads=tiers["own_disk"], l2_lent=c.l2_lent, read_bytes=c.bytes_read,
                   copied_bytes=c.bytes_copied, l0_slots=lm.pool.capacity,
                   l0_layer_slots=None if lm.pool.shared_l0 else [lm.pool.capacities[layer]
                                                                  for layer in sorted(lm.pool.layers)],
                   l0_rows=lm.pool.rows,
                   l0_bytes=lm.pool.nbytes, l0_ceiling_bytes=lm.pool.ceiling_bytes,
                   layers=sorted(lm.pool.layers),
                   daemon=None if client is None else {"address": client.address, "attached": client.attached,
                                                       "attaches": client.attaches, "last_error": client.last_error,
                                                       "link": asdict(client.counts),
                                                       "waits": asdict(lm.pool.waits)},
                   streaming=run.stats,
                   prefetch=None if lm.next_layer is None else {"predictor": lm.next_layer.describe(),
                                                                **run.prefetch.to_json()},
                   peak_rss_bytes=peak_rss_bytes(), peak_mlx_bytes=mx.get_peak_memory())

    def by_source(self) -> dict[str, int]:
        return {"l0": self.l0_hits, "l2": self.l2_hits, "daemon_disk": self.daemon_reads, "own_disk": self.l3_reads}

    def plus(self, other: StreamFigures) -> StreamFigures:
        """Two ranks' figures as one pipeline's: this one's, with the counts summed."""
        return replace(self, **{name: getattr(self, name) + getattr(other, name) for name in self.SUMMED},
                       layers=sorted([*self.layers, *other.layers]),
                       l0_slots=max(self.l0_slots, other.l0_slots),
                       l0_layer_slots=None if self.l0_layer_slots is None or other.l0_layer_slots is None else
                       [rows for _, rows in sorted([*zip(self.layers, self.l0_layer_slots),
                                                    *zip(other.layers, other.l0_layer_slots)])],
                       peak_rss_bytes=max(self.peak_rss_bytes, other.peak_rss_bytes),
                       peak_mlx_bytes=max(self.peak_mlx_bytes, other.peak_mlx_bytes))

    def to_json(self) -> dict:
        return {"expert_lookups": sum(self.by_source().values()),
                **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_json(cls, data: dict) -> StreamFigures:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class GenerationSummary:
    """A run's numbers as `moe-l2 generate` prints them (to_json: --json's object). `stream` is this process'
    figures, or a pipeline's summed over `ranks` (docs/distributed.md)."""

    model: str
    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float | None
    generation_tokens: int
    generation_tps: float | None
    stream: StreamFigures
    l0_shared: bool                          # l0_slots counts rows in all, not per layer
    ranks: tuple[StreamFigures, ...] = ()    # a pipelined run's per-rank figures, in rank order
    trace_out: str | None = None

    @classmethod
    def of(cls, run: Generation, lm) -> GenerationSummary:
        return cls(model=str(lm.files.path), text=run.text, tokens=run.tokens, finish_reason=run.finish_reason,
                   prompt_tokens=run.prompt_tokens, prompt_tps=run.prompt_tps,
                   generation_tokens=run.generation_tokens, generation_tps=run.generation_tps,
                   stream=StreamFigures.of(run, lm), l0_shared=lm.pool.shared_l0)

    def merged(self, ranks: list[StreamFigures]) -> GenerationSummary:
        """This (rank 0's) summary for a pipelined run: the ranks' figures summed, and each kept."""
        total = ranks[0]
        for one in ranks[1:]:
            total = total.plus(one)
        return replace(self, stream=total, ranks=tuple(ranks))

    def rates(self) -> dict:
        """Each source's share of the lookups (client.pool.source_shares)."""
        return source_shares(self.stream.by_source())

    def to_json(self) -> dict:
        rates = self.rates()
        out = {"model": self.model, "text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
               "prompt_tokens": self.prompt_tokens, "prompt_tps": self.prompt_tps,
               "generation_tokens": self.generation_tokens, "generation_tps": self.generation_tps,
               **self.stream.to_json(),
               "l0_hit_rate": rates["l0"], "l2_hit_rate": rates["l2"], "daemon_read_rate": rates["daemon_disk"],
               "l3_rate": rates["own_disk"], "disk_rate": rates["disk"], "l0_shared": self.l0_shared}
        if self.ranks:
            out["ranks"] = [{"rank": r, **one.to_json()} for r, one in enumerate(self.ranks)]
        if self.trace_out is not None:
            out["trace_out"] = self.trace_out
        return out
