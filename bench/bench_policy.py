"""Cache policies, hints and the domain predictor on real routing traces: the numbers of docs/policy-report.md.

Sections (each writes <results>/<section>.json and prints Markdown tables; --sections picks them; the learned
section writes its file after each of its runs, so one stopped early keeps what it finished):

- main:        every trace x order (blocked, interleave seed 0) x capacity (25, 37.5, 50% of the experts):
               hit rate of adaptive (the default), LRU, LFU and Belady's MIN, through `moe_l2.cache.replay`, all
               layers; per-layer wins; the PNG plot docs/policy-hit-rate.png.
- hints:       held out: profiles built from one half of the sequences (even / odd positions in the file),
               replayed on the other half, both ways, on every 6th layer. No hint vs profile prior vs hints from
               the predicted domain vs hints from the true domain (oracle); hit rate overall and over the first 32
               tokens after each domain switch, and the disk loads it costs.
- predictor:   held-out accuracy of the naive-Bayes predictor on the traces' prompts: 5-fold by prompt, and
               leaving whole subjects out (the component of `seq` before its last '/').
- sensitivity: the adaptive policy with other half-life grids and windows, on every 6th layer: how much the
               result depends on its two parameters.
- learned:     the learned policy against adaptive, LRU and MIN at the main section's points (all sequences,
               blocked and interleave), then on the held-out sequences (the odd-numbered ones of the seed-0
               shuffle; its settings were chosen on the others) in four mixes: interleave, blocked, blocked with
               the domains in reverse order, and 4 client processes taking turns; and the held-out interleave
               once more as a restarted daemon scores it, after the tuning half (replay --warm); all layers.
- sweep:       the learned policy against LRU at every capacity, held-out sequences, every 6th layer.
- foresight:   a bound, not a policy: the learned policy told which experts the next D batches pick (Belady's
               knowledge, that far ahead), against the learned policy, LRU and MIN; layers 1-5, all sequences
               interleaved, at the main section's capacities.
- cost:        microseconds per lookup of the store with LRU, adaptive and learned, taking turns, with one client
               and with several reporting in turn, at layer 1 with layer 0's batches as context; the learned
               policy's memory per layer and per model.

    pip install matplotlib            # for the plot only; not a dependency of moe-l2
    python bench/bench_policy.py [--traces ../shared/traces] [--sections main,hints,predictor,sensitivity,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from moe_l2.sizes import format_pct, format_size
from moe_l2.cache import learned
from moe_l2.cache import policy as policies
from moe_l2.cache import replay as rp
from moe_l2.cache.prediction import cross_validate
from moe_l2.cache.profile import Profile
from moe_l2.cache.replay_results import gap_closed
from moe_l2.cache.trace import TraceSet, read_traces
from moe_l2.lab.synthetic import GEOMETRIES

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.25, 0.375, 0.5)


def slots_for(n_experts: int, fractions=FRACTIONS) -> list[int]:
    return [max(1, round(f * n_experts)) for f in fractions]


def pct(x) -> str:
    return format_pct(x, sign=False)


def subset(traces: TraceSet, sequences) -> TraceSet:
    return TraceSet(traces.model, traces.n_layers, traces.n_experts, traces.top_k, list(sequences), traces.paths)


# ---- main -----------------------------------------------------------------------------------------------


def section_main(traces_by_file: dict, jobs: int) -> dict:
    out = {}
    for name, traces in traces_by_file.items():
        for order in ("blocked", "interleave"):
            start = time.time()
            result = rp.replay(traces, slots=slots_for(traces.n_experts), policy="adaptive", order=order, seed=0,
                               jobs=jobs).to_json()
            result["seconds"] = time.time() - start
            out[f"{name}|{order}"] = result
            print(f"  {name} {order}: {result['seconds']:.0f} s", file=sys.stderr, flush=True)
    return out


def report_main(results: dict) -> str:
    lines = ["| trace | order | slots (share) | adaptive | LRU | LFU | MIN | gap closed vs LRU | vs best of LRU/LFU "
             "| layers adaptive >= LRU and LFU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        name, order = key.split("|")
        for c in r["capacities"]:
            p = {n: c["policies"][n]["hit_rate"] for n in ("adaptive", "lru", "lfu", "min")}
            best = max(p["lru"], p["lfu"])
            gap_best = (p["adaptive"] - best) / (p["min"] - best) if p["min"] > best else None
            per = {n: c["policies"][n]["per_layer"] for n in ("adaptive", "lru", "lfu")}
            wins = sum(a >= max(l, f) for a, l, f in zip(per["adaptive"], per["lru"], per["lfu"]))
            lines.append(f"| {name} | {order} | {c['slots']} ({100 * c['share']:.1f}%) | **{pct(p['adaptive'])}** | "
                         f"{pct(p['lru'])} | {pct(p['lfu'])} | {pct(p['min'])} | "
                         f"{100 * c['gap_closed_vs_lru']:.0f}% | "
                         f"{'-' if gap_best is None else f'{100 * gap_best:.0f}%'} "
                         f"| {wins}/{len(per['adaptive'])} |")
    lines.append("")
    lines.append("| trace | order | slots | first 32 tokens after a domain switch: adaptive | LRU | switches |")
    lines.append("|---|---|---|---|---|---|")
    for key, r in results.items():
        name, order = key.split("|")
        for c in r["capacities"]:
            lines.append(f"| {name} | {order} | {c['slots']} | {pct(c['policies']['adaptive']['switch_hit_rate'])} | "
                         f"{pct(c['policies']['lru']['switch_hit_rate'])} | {r['domain_switches']} |")
    return "\n".join(lines)


def plot_main(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        return
    keys = list(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    styles = {"min": ("k", "--", "Belady MIN (ceiling)"), "adaptive": ("tab:red", "-", "adaptive (default)"),
              "lfu": ("tab:green", "-.", "LFU (decay)"), "lru": ("tab:blue", ":", "LRU")}
    for ax, key in zip(axes[0], keys):
        r = results[key]
        xs = [100 * c["share"] for c in r["capacities"]]
        for name, (color, style, label) in styles.items():
            ys = [100 * c["policies"][name]["hit_rate"] for c in r["capacities"]]
            ax.plot(xs, ys, color=color, linestyle=style, marker="o", label=label)
        name, order = key.split("|")
        ax.set_title(f"{name.split('.')[0]}, {order}", fontsize=10)
        ax.set_xlabel("L2 capacity (% of a layer's experts)")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("hit rate (%)")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


# ---- hints ----------------------------------------------------------------------------------------------

HINT_CONFIGS = {
    "no hint": {},
    "profile prior at start": {"prior": 1.0},
    "hints (predicted)": {"hints": "prompt"},
    "hints (oracle)": {"hints": "oracle"},
    "oracle, pins only (no prior)": {"hints": "oracle", "hint_prior": 0.0},
    "oracle, prior only (no pins)": {"hints": "oracle", "hint_share": 0.0},
    "oracle, pins of top experts without the lift rule": {"hints": "oracle", "hint_prior": 0.0, "hint_lift": 0.0},
}


def section_hints(traces_by_file: dict, jobs: int, layer_step: int) -> dict:
    out = {}
    for name, traces in traces_by_file.items():
        has_prompts = any(s.prompt for s in traces.sequences)
        halves = [traces.sequences[0::2], traces.sequences[1::2]]
        layers = list(range(0, traces.n_layers, layer_step))
        slots = slots_for(traces.n_experts, (0.25, 0.5))
        for order in ("blocked", "interleave"):
            for config, kw in HINT_CONFIGS.items():
                if kw.get("hints") == "prompt" and not has_prompts:
                    continue
                agg = {}
                for train, test in ((halves[0], halves[1]), (halves[1], halves[0])):
                    profile = Profile.from_traces(subset(traces, train))
                    r = rp.replay(subset(traces, test), slots=slots, policy="adaptive", order=order, seed=0,
                                  profile=profile, compare=("lru",), belady=False, layers=layers, jobs=jobs,
                                  **kw).to_json()
                    for c in r["capacities"]:
                        a = agg.setdefault(c["slots"], {"hits": 0, "lookups": 0, "loads": 0, "preloads": 0,
                                                        "switch": [], "lru": [], "lru_switch": [],
                                                        "hint_stats": []})
                        p = c["policies"]["adaptive"]
                        for k in ("hits", "lookups", "loads", "preloads"):
                            a[k] += p[k]
                        a["switch"].append(p["switch_hit_rate"])
                        a["lru"].append(c["policies"]["lru"]["hit_rate"])
                        a["lru_switch"].append(c["policies"]["lru"]["switch_hit_rate"])
                        a["hint_stats"].append(r["hint_stats"])
                out[f"{name}|{order}|{config}"] = agg
                print(f"  hints {name} {order} {config}", file=sys.stderr, flush=True)
    return out


def report_hints(results: dict) -> str:
    lines = ["| trace | order | slots | configuration | hit rate | first 32 tokens after a switch | disk loads "
             "(of which preloads) | LRU hit rate / after a switch |", "|---|---|---|---|---|---|---|---|"]
    for key, agg in results.items():
        name, order, config = key.split("|")
        for slots, a in sorted(agg.items(), key=lambda kv: int(kv[0])):
            sw = [x for x in a["switch"] if x is not None]
            lsw = [x for x in a["lru_switch"] if x is not None]
            lines.append(f"| {name} | {order} | {slots} | {config} | {pct(a['hits'] / a['lookups'])} | "
                         f"{pct(sum(sw) / len(sw) if sw else None)} | {a['loads'] + a['preloads']} "
                         f"({a['preloads']}) | {pct(sum(a['lru']) / len(a['lru']))} / "
                         f"{pct(sum(lsw) / len(lsw) if lsw else None)} |")
    return "\n".join(lines)


# ---- predictor ------------------------------------------------------------------------------------------


def section_predictor(traces_by_file: dict) -> dict:
    out = {}
    for name, traces in traces_by_file.items():
        examples = [(s.prompt, s.domain, s.seq) for s in traces.sequences if s.prompt and s.domain]
        if len({d for _, d, _ in examples}) < 2:
            out[name] = None
            continue
        pairs = [(t, d) for t, d, _ in examples]
        by_prompt = cross_validate(pairs, folds=5)
        # The subject: the component of `seq` before the last one ("mmlu_dev/anatomy/True_False" -> "anatomy"),
        # so that the dev and validation questions of a subject fall in the same fold.
        subject = [(seq.split("/")[-2] if seq.count("/") >= 1 else seq) for _, _, seq in examples]
        by_subject = cross_validate(pairs, folds=5, group=lambda i: subject[i])
        model = Profile.from_traces(traces).predictor
        start = time.perf_counter()
        for t, _ in pairs:
            model.predict(t)
        per_prompt = (time.perf_counter() - start) / len(pairs)
        out[name] = {"by_prompt": by_prompt, "by_subject": by_subject, "predict_seconds": per_prompt}
    return out


def report_predictor(results: dict) -> str:
    lines = []
    for name, r in results.items():
        if r is None:
            lines.append(f"{name}: no prompts, no predictor.")
            continue
        a, b = r["by_prompt"], r["by_subject"]
        lines.append(f"{name}: {a['examples']} prompts; predicting one takes {1000 * r['predict_seconds']:.2f} ms.")
        lines.append("")
        lines.append("| held out | accuracy | majority class | share with confidence >= 0.5 | accuracy among those |")
        lines.append("|---|---|---|---|---|")
        for label, x in (("5-fold by prompt", a), ("5-fold by subject (unseen subjects)", b)):
            lines.append(f"| {label} | {pct(x['accuracy'])} | {pct(x['majority_baseline'])} | "
                         f"{pct(x['confident_share'])} | {pct(x['confident_accuracy'])} |")
        lines.append("")
        lines.append("| domain | prompts | accuracy by prompt | by subject |")
        lines.append("|---|---|---|---|")
        for d, v in a["per_domain"].items():
            lines.append(f"| {d} | {v['n']} | {pct(v['accuracy'])} | {pct(b['per_domain'][d]['accuracy'])} |")
    return "\n".join(lines)


# ---- sensitivity ----------------------------------------------------------------------------------------

VARIANTS = {
    "default: h = 1,16,64,256,1024,4096; window 4096": {},
    "window 1024": {"window": 1024.0},
    "window 16384": {"window": 16384.0},
    "h = 1,8,32,128,512,2048,8192": {"half_lives": (1.0, 8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0)},
    "h = 1,64,1024 only": {"half_lives": (1.0, 64.0, 1024.0)},
    "fixed h = 128 (no adaptation)": {"half_lives": (128.0,)},
}


def section_sensitivity(traces_by_file: dict, jobs: int, layer_step: int) -> dict:
    out = {}
    base_init = policies.AdaptiveLRFU.__init__.__defaults__
    try:
        for variant, kw in VARIANTS.items():
            policies.AdaptiveLRFU.__init__.__defaults__ = (
                None, kw.get("half_lives", policies.AdaptiveLRFU.HALF_LIVES),
                kw.get("window", policies.AdaptiveLRFU.WINDOW))
            for name, traces in traces_by_file.items():
                layers = list(range(0, traces.n_layers, layer_step))
                for order in ("blocked", "interleave"):
                    # jobs=1: the spawned workers would not see the patched defaults.
                    r = rp.replay(traces, slots=slots_for(traces.n_experts, (0.25, 0.5)), policy="adaptive",
                                  order=order, seed=0, compare=("lru", "lfu"), belady=False, layers=layers,
                                  jobs=1).to_json()
                    out[f"{variant}|{name}|{order}"] = {
                        c["slots"]: {n: c["policies"][n]["hit_rate"] for n in ("adaptive", "lru", "lfu")}
                        for c in r["capacities"]}
            print(f"  sensitivity {variant}", file=sys.stderr, flush=True)
    finally:
        policies.AdaptiveLRFU.__init__.__defaults__ = base_init
    return out


def report_sensitivity(results: dict) -> str:
    cols = sorted({tuple(k.split("|")[1:]) for k in results})
    head = "| variant | " + " | ".join(f"{n.split('.')[0]} {o} {s}" for n, o in cols
                                         for s in sorted(next(v for k, v in results.items()
                                                              if k.endswith(f"|{n}|{o}")), key=int)) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    variants = list(dict.fromkeys(k.split("|")[0] for k in results))
    for variant in variants + ["LRU", "LFU"]:
        cells = []
        for n, o in cols:
            src = results[f"{variants[0]}|{n}|{o}"] if variant in ("LRU", "LFU") else results[f"{variant}|{n}|{o}"]
            for s in sorted(src, key=int):
                key = variant.lower() if variant in ("LRU", "LFU") else "adaptive"
                cells.append(pct(src[s][key]))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- learned --------------------------------------------------------------------------------------------

# The learned policy's settings were chosen on the even-numbered sequences of the seed-0 shuffle, 5 layers of each
# trace; the odd-numbered ones are held out, and every mix below of them is scored only once.
MIXES = ("interleave", "blocked", "blocked, domains reversed", "4 processes")
LEARNED_COMPARE = ("adaptive", "lru")


def held_out(traces: TraceSet) -> TraceSet:
    return subset(traces, rp.order_sequences(traces.sequences, "interleave", 0)[1::2])


def restarted(traces: TraceSet) -> tuple[TraceSet, dict]:
    """The tuning half, then the held-out sequences in the interleave mix's order, and the replay arguments that
    restart every policy between them (replay --warm): the held-out interleave scored as a restarted daemon would."""
    shuffled = rp.order_sequences(traces.sequences, "interleave", 0)
    tuning, held = shuffled[0::2], rp.order_sequences(shuffled[1::2], "interleave", 0)
    return subset(traces, tuning + held), {"order": "file", "warm": True, "train": len(tuning) / len(shuffled)}


def mixed(traces: TraceSet, mix: str) -> tuple[TraceSet, dict]:
    """The sequences as a mix runs them, and the replay arguments that run them so."""
    if mix == "blocked, domains reversed":
        domains = sorted({s.domain or "" for s in traces.sequences}, reverse=True)
        ordered = [s for d in domains for s in traces.sequences if (s.domain or "") == d]
        return subset(traces, ordered), {"order": "file"}
    if mix == "4 processes":
        return traces, {"order": "interleave", "processes": 4}
    return traces, {"order": mix}


def learned_point(c: dict) -> dict:
    ps = c["policies"]
    lru, ceiling = ps["lru"]["hit_rate"], ps["min"]["hit_rate"]
    return {"slots": c["slots"], "share": c["share"],
            **{n: {k: ps[n][k] for k in ("hit_rate", "misses_vs_min", "records_per_token", "bytes_per_token")}
               for n in ("learned", *LEARNED_COMPARE, "min")},
            "gap": {n: gap_closed(ps[n]["hit_rate"], lru, ceiling) for n in ("learned", "adaptive")}}


def section_learned(traces_by_file: dict, jobs: int, save) -> dict:
    """Each run's points are saved as the run ends (`save`): the section takes over an hour here."""
    out = {}
    for name, traces in traces_by_file.items():
        record = record_bytes(traces.model)
        runs = [("all", order, traces, {"order": order}) for order in ("blocked", "interleave")]
        runs += [("held out", mix, *mixed(held_out(traces), mix)) for mix in MIXES]
        runs.append(("held out, restarted", "interleave", *restarted(traces)))
        for part, mix, chosen, kw in runs:
            start = time.time()
            r = rp.replay(chosen, slots=slots_for(traces.n_experts), policy="learned", compare=LEARNED_COMPARE,
                          seed=0, jobs=jobs, record_bytes=record, **kw).to_json()
            out[f"{name}|{part}|{mix}"] = [learned_point(c) for c in r["capacities"]]
            save(out)
            print(f"  learned {name} {part} {mix}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def report_learned(results: dict) -> str:
    lines = ["| trace | sequences | mix | slots | learned | adaptive | LRU | MIN | gap closed: learned (adaptive) | "
             "misses vs MIN: learned (adaptive) | disk per token: learned / adaptive |", "|" + "---|" * 11]
    groups: dict[str, list] = {}
    for key, points in results.items():
        name, part, mix = key.split("|")
        for p in points:
            groups.setdefault(part, []).append(p)
            size = (f"{format_size(p['learned']['bytes_per_token'])} / {format_size(p['adaptive']['bytes_per_token'])}"
                    if p["learned"]["bytes_per_token"] is not None else "-")
            lines.append(f"| {name.split('.')[0]} | {part} | {mix} | {p['slots']} ({100 * p['share']:g}%) | "
                         f"**{pct(p['learned']['hit_rate'])}** | {pct(p['adaptive']['hit_rate'])} | "
                         f"{pct(p['lru']['hit_rate'])} | {pct(p['min']['hit_rate'])} | "
                         f"{100 * p['gap']['learned']:.0f}% ({100 * p['gap']['adaptive']:.0f}%) | "
                         f"{p['learned']['misses_vs_min']:.2f}x ({p['adaptive']['misses_vs_min']:.2f}x) | {size} |")
    lines.append("")
    for part, points in groups.items():
        gaps = {n: sum(p["gap"][n] for p in points) / len(points) for n in ("learned", "adaptive")}
        worst = {n: max(p[n]["misses_vs_min"] for p in points) for n in ("learned", "adaptive")}
        below = sum(p["learned"]["hit_rate"] < p["adaptive"]["hit_rate"] for p in points)
        lines.append(f"- {part} ({len(points)} points): gap closed on average {100 * gaps['learned']:.0f}% "
                     f"(adaptive {100 * gaps['adaptive']:.0f}%); misses at most {worst['learned']:.2f}x MIN's "
                     f"(adaptive {worst['adaptive']:.2f}x); below adaptive at {below}")
    return "\n".join(lines)


def section_sweep(traces_by_file: dict, jobs: int, layer_step: int) -> dict:
    """The learned policy against LRU at every capacity (every other one past 32 slots), held-out sequences."""
    out = {}
    for name, traces in traces_by_file.items():
        n = traces.n_experts
        slots = [s for s in range(1, n) if s <= 32 or s % 2 == 0]
        r = rp.replay(held_out(traces), slots=slots, policy="learned", compare=("lru",), belady=False, seed=0,
                      layers=list(range(0, traces.n_layers, layer_step)), jobs=jobs).to_json()
        out[name] = {c["slots"]: {p: c["policies"][p]["hits"] for p in ("learned", "lru")} | {
            "lookups": c["policies"]["lru"]["lookups"]} for c in r["capacities"]}
    return out


def report_sweep(results: dict) -> str:
    lines = []
    for name, points in results.items():
        diffs = {int(s): (p["learned"] - p["lru"]) / p["lookups"] for s, p in points.items()}
        worst = min(diffs, key=diffs.get)
        losses = [s for s, d in diffs.items() if d < 0]
        lines.append(f"- {name.split('.')[0]}: {len(diffs)} capacities, learned minus LRU from "
                     f"{100 * diffs[worst]:+.3f} points (at {worst} slots) to {100 * max(diffs.values()):+.1f}; "
                     f"below LRU at {', '.join(map(str, losses)) or 'none'}")
    return "\n".join(lines)


# ---- foresight ------------------------------------------------------------------------------------------

FORESIGHT = (1, 2, 4, 8)  # batches the bound sees ahead
FORESIGHT_LAYERS = (1, 2, 3, 4, 5)


class Foresight:
    """The learned policy, told each expert's next pick where it falls within the next `ahead` batches: those are
    kept, the one picked latest evicted first among them, and the rest ranked by the model. It reads the future,
    so it bounds what a better prediction of the next `ahead` batches could give; nothing online can run it."""

    def __init__(self, n_experts: int, slots: int, batches: list, ahead: int) -> None:
        self.model = learned.LearnedReuse(n_experts, slots)
        self.future = policies.BeladyMIN(batches)
        self.ahead = ahead

    def at(self, t: int) -> None:
        self.future.at(t)

    def observe(self, experts, source=None, context=None) -> None:
        self.model.observe(experts, source, context)

    def insert(self, expert: int) -> None:
        pass

    def evict(self, expert: int) -> None:
        pass

    def _wait(self, expert: int) -> float:
        return self.future.next_use(expert) - self.future.now

    def victim(self, candidates) -> int:
        unforeseen = [c for c in candidates if self._wait(c) > self.ahead]
        if unforeseen:
            return self.model.victim(unforeseen)
        return max(sorted(candidates), key=self._wait)

    def load_order(self, misses: list[int]) -> list[int]:
        """As MIN loads: what a later load of the token may evict first (the unforeseen, coldest first)."""
        unforeseen = [e for e in misses if self._wait(e) > self.ahead]
        foreseen = sorted((e for e in misses if self._wait(e) <= self.ahead), key=lambda e: (-self._wait(e), e))
        return self.model.hottest(unforeseen)[::-1] + foreseen


def foresight_run(job: tuple) -> tuple:
    layer, slots, name, ahead, batches, n_experts, context = job
    task = rp.Task(layer, slots, name, batches, n_experts, context=context)
    bound = Foresight(n_experts, slots, batches, ahead) if ahead else None
    r = rp.replay_layer(task, bound)
    return slots, name, ahead, r["hits"], r["lookups"]


def section_foresight(traces_by_file: dict, jobs: int) -> dict:
    """Hit rates of LRU, MIN, the learned policy and its Foresight bounds, over layers 1-5, per capacity."""
    out = {}
    for name, traces in traces_by_file.items():
        tokens = [t for s in rp.order_sequences(traces.sequences, "interleave", 0) for t in s.experts]
        batches = {layer: [tuple(t[layer]) for t in tokens] for layer in (0, *FORESIGHT_LAYERS)}
        runs = [("lru", 0), ("min", 0), ("learned", 0)] + [("learned", d) for d in FORESIGHT]
        work = [(layer, slots, policy, ahead, batches[layer], traces.n_experts, batches[layer - 1])
                for slots in slots_for(traces.n_experts) for policy, ahead in runs for layer in FORESIGHT_LAYERS]
        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(foresight_run, work, chunksize=1))
        hits: dict = {}
        for slots, policy, ahead, h, lookups in done:
            got = hits.setdefault(f"{slots}|{policy}|{ahead}", [0, 0])
            got[0] += h
            got[1] += lookups
        out[name] = {"n_experts": traces.n_experts,
                     "hit_rates": {key: h / lookups for key, (h, lookups) in hits.items()}}
    return out


def report_foresight(results: dict) -> str:
    heads = " | ".join(f"told {d} ahead" for d in FORESIGHT)
    lines = [f"| trace | slots | learned | {heads} |", "|---|---|---|" + "---|" * len(FORESIGHT)]
    for name, result in results.items():
        rates = result["hit_rates"]
        for slots in sorted({int(key.split("|")[0]) for key in rates}):
            lru, ceiling = rates[f"{slots}|lru|0"], rates[f"{slots}|min|0"]

            def cell(ahead: int) -> str:
                rate = rates[f"{slots}|learned|{ahead}"]
                return f"{100 * gap_closed(rate, lru, ceiling):.0f}%, {(1 - rate) / (1 - ceiling):.2f}x"
            lines.append(f"| {name.split('.')[0]} | {slots} ({100 * slots / result['n_experts']:g}%) | {cell(0)} | "
                         + " | ".join(cell(d) for d in FORESIGHT) + " |")
    return "\n".join(lines)


def record_bytes(model: str) -> int | None:
    geometry = GEOMETRIES.get(model)
    return geometry.layout().nbytes if geometry is not None else None


# ---- cost -----------------------------------------------------------------------------------------------

COST_POLICIES = ("lru", "adaptive", "learned")


def zipf_batches(n_experts: int, top_k: int, tokens: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(n_experts)]
    return [tuple(set(rng.choices(range(n_experts), weights, k=top_k))) for _ in range(tokens)]


def section_cost(traces_by_file: dict, repeat: int = 3) -> dict:
    """Microseconds per lookup of the store with each policy (replay_layer: the policy's work and the store's), the
    policies taking turns, with one client and with the batches reported by several in turn (the learned policy
    combines every recent client's chances on each batch), each token's batch at the layer before given as context
    (a second Zipf stream for the synthetic ones); and the learned policy's memory per layer."""
    cases = []
    for name, traces in traces_by_file.items():
        tokens = [t for s in traces.sequences for t in s.experts][:20000]
        batches, before = [tuple(t[1]) for t in tokens], [tuple(t[0]) for t in tokens]
        label, n = f"{name.split('.')[0]} layer 1", traces.n_experts
        for share in (0.25, 0.5):
            cases.append((label, n, round(share * n), batches, before, 1))
        cases.append((f"{label}, 4 clients", n, n // 2, batches, before, 4))
    for n, k in ((128, 8), (256, 8)):
        cases.append((f"zipf, {n} experts, top-{k}", n, n // 4, zipf_batches(n, k, 8000),
                      zipf_batches(n, k, 8000, seed=1), 1))
    cases.append((f"zipf, 256 experts, top-8, {learned.MAX_SOURCES} clients", 256, 64, zipf_batches(256, 8, 8000),
                  zipf_batches(256, 8, 8000, seed=1), learned.MAX_SOURCES))
    out = {"lookups": {}, "memory": {}}
    for label, n, slots, batches, before, clients in cases:
        sources = [t % clients for t in range(len(batches))] if clients > 1 else None
        times = {p: [] for p in COST_POLICIES}
        for _ in range(repeat):
            for p in COST_POLICIES:
                start = time.perf_counter()
                r = rp.replay_layer(rp.Task(1, slots, p, batches, n, sources=sources, context=before))
                times[p].append((time.perf_counter() - start) / r["lookups"] * 1e6)
        out["lookups"][f"{label}|{slots}|{n}"] = {p: statistics.median(t) for p, t in times.items()}
    for geometry in GEOMETRIES.values():
        out["memory"][geometry.name] = memory_of(geometry.n_experts, geometry.top_k, geometry.n_moe_layers)
    out["memory"]["256 experts, top-8 (DeepSeek-V3's shape)"] = memory_of(256, 8, 58)
    return out


def memory_of(n_experts: int, top_k: int, layers: int) -> dict:
    """The learned policy's bytes per layer at its most (every pending batch held, with its context, MAX_SOURCES
    clients), and per model."""
    policy = learned.LearnedReuse(n_experts, learned.HORIZON_RANGE[1] * top_k)
    rng = random.Random(0)
    for t in range(4 * learned.HORIZON_RANGE[1]):
        policy.observe(rng.sample(range(n_experts), top_k), source=t % learned.MAX_SOURCES,
                       context=rng.sample(range(n_experts), top_k))
    return {"layer": policy.nbytes, "model": policy.nbytes * layers, "layers": layers}


def report_cost(results: dict) -> str:
    lines = ["| stream | slots | LRU | adaptive | learned | learned / adaptive |", "|---|---|---|---|---|---|"]
    for key, t in results["lookups"].items():
        label, slots, n = key.split("|")
        lines.append(f"| {label} | {slots} of {n} | {t['lru']:.1f} | {t['adaptive']:.1f} | {t['learned']:.1f} | "
                     f"{t['learned'] / t['adaptive']:.2f}x |")
    lines += ["", "| model | learned policy's memory per layer | per model |", "|---|---|---|"]
    for name, m in results["memory"].items():
        lines.append(f"| {name} ({m['layers']} layers) | {format_size(m['layer'])} | {format_size(m['model'])} |")
    return "\n".join(lines)


# ---- driver ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces",
                        help="folder of *.jsonl.gz traces (default ../shared/traces beside the repo)")
    parser.add_argument("--sections", default="main,hints,predictor,sensitivity,learned,sweep,foresight,cost")
    parser.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "moe-l2-bench-policy",
                        help="where each section's JSON goes (and --report-only reads it)")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "policy-hit-rate.png")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--layer-step", type=int, default=6,
                        help="the hints and sensitivity sections replay every Nth layer (default 6)")
    parser.add_argument("--report-only", action="store_true", help="print the tables of saved results")
    args = parser.parse_args()
    files = sorted(args.traces.glob("*.jsonl.gz"))
    if not files and not args.report_only:
        print(f"no traces in {args.traces}", file=sys.stderr)
        return 1
    traces = {} if args.report_only else {f.name: read_traces(f) for f in files}
    args.results.mkdir(parents=True, exist_ok=True)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]

    def path(section: str) -> Path:
        return args.results / f"{section}.json"

    def write(section: str, data: dict) -> None:
        path(section).write_text(json.dumps(data, indent=1))

    runners = {
        "main": (lambda: section_main(traces, args.jobs), report_main),
        "hints": (lambda: section_hints(traces, args.jobs, args.layer_step), report_hints),
        "predictor": (lambda: section_predictor(traces), report_predictor),
        "sensitivity": (lambda: section_sensitivity(traces, args.jobs, args.layer_step), report_sensitivity),
        "learned": (lambda: section_learned(traces, args.jobs, lambda data: write("learned", data)), report_learned),
        "sweep": (lambda: section_sweep(traces, args.jobs, args.layer_step), report_sweep),
        "foresight": (lambda: section_foresight(traces, args.jobs), report_foresight),
        "cost": (lambda: section_cost(traces), report_cost),
    }
    for section in sections:
        compute, report = runners[section]
        if args.report_only:
            data = json.loads(path(section).read_text())
        else:
            start = time.time()
            data = compute()
            write(section, data)
            print(f"{section}: {time.time() - start:.0f} s", file=sys.stderr)
        print(f"\n## {section}\n")
        print(report(data))
        if section == "main":
            plot_main(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
