"""Replay: routing traces through the daemon's own slot store and eviction policies (`moe-l2 replay`).

Every layer gets a `moe_l2.cache.store.LayerStore` with the policy under test, as the daemon builds them,
and sees the trace's tokens as the daemon sees a client's reports: for each token the experts the router
picked are looked up (hit: resident), the policy is told of every access, and the misses it admits are loaded
(reserve + commit, evicting what the policy names, as the fill desk reserves for a process' gives). Loads complete
before the next token, so the numbers are the policy's, not the disk's. No shared memory is touched.

Beside the chosen policy every capacity is also run with the comparison policies (adaptive, LRU and LFU by
default) and with Belady's MIN, the offline optimum, as the ceiling. `--hints` sends each sequence's prompt as a
hint first, through the daemon's hint code (`LayerStore.apply_hint`: predict the domain, pin its top
experts within the pin budget and load them). Layers are independent, so they run on a process pool.

Sequence order: `blocked` groups the sequences by domain (domains in name order, file order inside),
`interleave` shuffles them with `--seed`, `file` keeps them as the files hold them. Results are deterministic
for a given seed. `--processes N` runs them as N clients would: each takes the next sequence when its own ends,
and they take turns token by token; the policy is told which client each token came from, as the daemon knows
the sender of each report.

Every policy's loads are also set against MIN's (`misses_vs_min`) and, where the record size is known, as bytes
per token: what the disk reads.

`--prefetch` scores next-layer predictors (moe_l2.cache.prefetch) with the chosen policy: the sequences are
split, the predictor learns from the first `train` share and every policy is scored on the rest only.
At each token, layer l+1's guesses (made at layer l, from layer l's experts) are loaded before layer l+1's
lookup, never evicting another guess: every prefetch is taken to land in time, since it has layer l's whole
compute to do so. The predictor keeps learning online, a block of tokens after guessing it.

`--ceilings` runs the policy under test and LRU (L0's policy) also with per-layer ceilings: the slots of a
capacity in all layers, split by the hit curves of the first `train` share (src/moe_l2/cache/ceilings.py, what
`moe-l2 profile` learns and `l0_ceilings` uses), scored on the rest only: the held-out figure of the split.

`--warm` scores the policies as a restarted moe-l2d has them (docs/architecture.md, "Warm after a restart"): each
first runs over the first `train` share, then its state is saved and restored and its store preloaded with what
it held, hottest first; every policy is scored on the rest only, MIN from an empty store.
"""

from __future__ import annotations

import random
from array import array
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np

from moe_l2.cache.ceilings import sequence_curves, split_rows
from moe_l2.cache.heat import Heat, pin_limit
from moe_l2.cache.policy import DEFAULT_POLICY, POLICIES, BeladyMIN, make_policy, restored_policy
from moe_l2.cache.prediction import PredictorError
from moe_l2.cache.prefetch import REPLAY_PREDICTORS, guess_streams
from moe_l2.cache.score import Score
from moe_l2.cache.replay_results import ReplayResult, Tally
from moe_l2.cache.profile import MIN_CONFIDENCE, Profile
from moe_l2.cache.store import HINT_MIN_LIFT, HINT_PIN_SHARE, HINT_PRIOR, LayerStore
from moe_l2.cache.trace import TraceSet

ORDERS = ("interleave", "blocked", "file")
DEFAULT_FRACTIONS = (0.25, 0.375, 0.5)
SWITCH_WINDOW = 32  # tokens after a domain switch whose hit rate is reported on its own


class ReplayError(ValueError):
    pass


def order_sequences(sequences: list, order: str, seed: int = 0) -> list:
    if order == "blocked":
        domains = sorted({s.domain or "" for s in sequences})
        return [s for d in domains for s in sequences if (s.domain or "") == d]
    if order == "interleave":
        out = list(sequences)
        random.Random(seed).shuffle(out)
        return out
    if order == "file":
        return list(sequences)
    raise ReplayError(f"unknown order {order!r}; choose {' or '.join(ORDERS)}")


@dataclass(frozen=True)
class HintPlan:
    """What a client would send before each sequence, decided once for all layers: the domain per
    sequence start (None: send nothing, the daemon keeps its current pins; "" : release the pins)."""

    starts: tuple[int, ...]
    domains: tuple[str | None, ...]


def plan_hints(sequences: list, profile: Profile, source: str = "prompt") -> tuple[HintPlan, dict]:
    """Predict each sequence's domain from its prompt, as the daemon's hint handler does."""
    starts, domains = [], []
    sent = correct = confident = 0
    t = 0
    for s in sequences:
        starts.append(t)
        t += s.n_tokens
        domain = None
        if source == "oracle":
            domain = s.domain if s.domain in profile.domains else None
            sent += domain is not None
        elif s.prompt:
            sent += 1
            p = profile.predict(s.prompt)
            if p.confidence >= MIN_CONFIDENCE:
                domain = p.domain
                confident += 1
            correct += p.domain == s.domain
        domains.append(domain)
    return HintPlan(tuple(starts), tuple(domains)), {"hints_sent": sent, "confident": confident,
                                                     "predicted_correctly": correct}


@dataclass(frozen=True)
class Task:
    layer: int
    slots: int
    policy: str
    batches: list
    n_experts: int
    hints: HintPlan | None = None
    profile: Profile | None = None
    prior: float = 0.0       # strength of the profile's all-domain prior seeded at start
    hint_share: float = HINT_PIN_SHARE
    hint_prior: float = HINT_PRIOR  # strength of the domain prior a hint adds
    record_tokens: bool = False
    hint_lift: float = HINT_MIN_LIFT
    guesses: list | None = None  # per token, experts to load before its lookup (next-layer prefetch)
    label: str = ""  # the result's name when it is not the policy's (a prefetch predictor, ceilings)
    point: int = 0   # the capacity it is reported under, where that is not `slots` (ceilings); 0: slots
    autopin_top_k: int = 0  # autopin: pin the layer's hottest experts (src/moe_l2/cache/heat.py), leaving this many
    sources: list | None = None  # per token, the client that sent it (--processes); None: one client
    warm: tuple | None = None  # (batches, sources, context) a restarted daemon's policy saw before (--warm)
    context: list | None = None  # per token, the batch at the layer before (None: the first layer)


def replay_layer(task: Task, policy=None) -> dict:
    """One layer, one capacity, one policy: the daemon's own LayerStore over the layer's token batches. `policy`:
    one made already (a bench's bound, which may read the batches' future), instead of the task's."""
    policy, held = (policy, []) if policy is not None else _started(task)
    store = LayerStore(task.n_experts, task.slots, policy)
    for e in held:
        store.commit(store.reserve(e))
    return _replayed(task, store, preloads=len(held))


def _replayed(task: Task, store: LayerStore, preloads: int) -> dict:
    """The task's batches through `store`, which holds its `preloads` already: the counts replay reports."""
    batches, policy = task.batches, store.policy
    if task.profile is not None and task.prior > 0 and hasattr(policy, "set_prior"):
        policy.set_prior(task.profile.shares(None, task.layer), task.prior)
    hint_at = {}
    if task.hints is not None:
        hint_at = {t: d for t, d in zip(task.hints.starts, task.hints.domains) if d is not None}
    at = getattr(policy, "at", None)
    load_order = getattr(policy, "load_order", None)
    slot, observe, reserve, commit = store.slot, store.observe, store.reserve, store.commit
    sources = task.sources
    heat = Heat(task.n_experts, pin_limit(task.slots, task.autopin_top_k)) if task.autopin_top_k else None
    hits = lookups = loads = 0
    prefetch_loads = useful = wasted = 0
    prefetched: set[int] = set()
    per_token = array("H", bytes(2 * len(batches))) if task.record_tokens else None
    for t, batch in enumerate(batches):
        if task.guesses is not None:
            keep = frozenset(task.guesses[t])
            for e in task.guesses[t]:
                r = reserve(e, keep) if not store.has(e) else None
                if r is not None:
                    wasted += r.evicted in prefetched
                    prefetched.discard(r.evicted)
                    commit(r)
                    prefetched.add(e)
                    prefetch_loads += 1
        if t in hint_at:
            domain = hint_at[t]
            pinned = store.apply_hint(task.profile, domain, task.layer, share=task.hint_share,
                                      prior=task.hint_prior, min_lift=task.hint_lift)
            for e in pinned:
                if not store.has(e):
                    r = reserve(e)
                    if r is not None:
                        commit(r)
                        preloads += 1
        if at is not None:
            at(t)
        misses = [e for e in batch if slot(e) < 0]
        h = len(batch) - len(misses)
        hits += h
        lookups += len(batch)
        if per_token is not None:
            per_token[t] = h
        observe(batch, sources[t] if sources is not None else None,
                task.context[t] if task.context is not None else None)
        if prefetched:
            demanded = prefetched.intersection(batch)
            useful += len(demanded)
            prefetched -= demanded
        if heat is not None and heat.add(batch):
            # As L0 does (client/layerpool.py): the new hot set is pinned where resident, the rest unpinned.
            store.unpin(store.pins("auto"), "auto")
            store.pin([e for e in heat.hot if slot(e) >= 0], "auto")
        if load_order is not None:
            misses = load_order(misses)
        for e in misses:
            r = reserve(e, optional=True)  # as the fill desk reserves for a give: the policy may refuse it
            if r is not None:
                if r.evicted in prefetched:
                    wasted += 1
                    prefetched.discard(r.evicted)
                commit(r)
                loads += 1
                if heat is not None and e in heat.hot:
                    store.pin([e], "auto")
    return {"layer": task.layer, "slots": task.slots, "policy": task.label or task.policy, "hits": hits,
            "lookups": lookups, "loads": loads, "preloads": preloads, "prefetch_loads": prefetch_loads,
            "useful": useful, "wasted": wasted,
            "per_token": per_token.tobytes() if per_token is not None else None}


def _started(task: Task) -> tuple[object, list[int]]:
    """The task's policy, and the experts its store starts with: none, or what a restart preloads (--warm)."""
    if task.policy == "min":
        return BeladyMIN(task.batches), []
    if task.warm is not None:
        return restarted(task)
    return make_policy(task.policy, capacity=task.slots, n_experts=task.n_experts), []


def restarted(task: Task) -> tuple[object, list[int]]:
    """The task's policy as moe-l2d has it after a restart that followed the batches `task.warm`: run over them in
    a store of its own, its state() restored (daemon/warm_start.py), and the experts that store held, hottest first,
    which the restarted daemon preloads."""
    policy = make_policy(task.policy, capacity=task.slots, n_experts=task.n_experts)
    store = LayerStore(task.n_experts, task.slots, policy)
    batches, sources, context = task.warm
    _replayed(Task(task.layer, task.slots, task.policy, batches, task.n_experts, sources=sources, context=context),
              store, preloads=0)
    held = policy.hottest(store.held())[:task.slots]
    return restored_policy(task.policy, policy.state(), task.n_experts, task.slots), held


def take_turns(sequences: list, processes: int) -> tuple[list, list[int]]:
    """The tokens in the order `processes` clients would send them, each running the sequences it takes in turn
    (the next one when its own ends), the clients taking turns token by token; and the client of each token."""
    queue = iter(sequences)
    running: dict[int, Iterator] = {client: iter(()) for client in range(processes)}  # each one's tokens left
    tokens, sources = [], []
    while running:
        for client in list(running):
            token = next(running[client], None)
            while token is None and (sequence := next(queue, None)) is not None:
                running[client] = iter(sequence.experts)
                token = next(running[client], None)
            if token is None:
                del running[client]
                continue
            tokens.append(token)
            sources.append(client)
    return tokens, sources


def _routed(sequences: list) -> np.ndarray:
    """(tokens, n_layers, top_k) expert ids of the sequences, in order."""
    tokens = [token for s in sequences for token in s.experts]
    try:
        return np.asarray(tokens, dtype=np.int64)
    except ValueError:
        raise ReplayError("--prefetch needs every token to pick the same number of experts at every layer") from None


def parse_slots(text: str | None, n_experts: int) -> list[int]:
    if not text:
        values = sorted({max(1, round(f * n_experts)) for f in DEFAULT_FRACTIONS})
    else:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ReplayError(f"--slots takes integers separated by commas, e.g. 8,12,16; got {text!r}") from None
    for v in values:
        if not 1 <= v <= n_experts:
            raise ReplayError(f"--slots {v}: a layer holds 1..{n_experts} experts")
    return values


def replay(traces: TraceSet, *, slots: list[int], policy: str = DEFAULT_POLICY, compare=("adaptive", "lru", "lfu"),
           order: str = "interleave", seed: int = 0, profile: Profile | None = None, hints: str | None = None,
           prior: float = 0.0, hint_share: float = HINT_PIN_SHARE, hint_prior: float = HINT_PRIOR,
           hint_lift: float = HINT_MIN_LIFT,
           layers: list[int] | None = None, jobs: int = 1, switch_window: int = SWITCH_WINDOW,
           belady: bool = True, prefetch: tuple[str, ...] = (), train: float = 0.5,
           prefetch_k: int | None = None, ceilings: bool = False, autopin: bool = False,
           layer_rows: list[int] | None = None, processes: int = 1, record_bytes: int | None = None,
           warm: bool = False) -> ReplayResult:
    """Run the trace and return what it measured (`moe-l2 replay` renders it as a table or JSON).

    hints: None, "prompt" (predict each sequence's domain from its prompt) or "oracle" (use the trace's
    domain label: what a perfect predictor would give).
    prefetch: next-layer predictors to score (REPLAY_PREDICTORS) with `policy`, each making prefetch_k
    guesses per token and layer (default top_k), trained on the first `train` share of the sequences;
    with any, every policy is scored on the other sequences only.
    ceilings: also run `policy` and LRU with per-layer slots split by the hit curves of that share, each capacity
    `slots` times the layers in all (named "<policy>+ceilings").
    autopin: also run `policy` and LRU pinning each layer's hottest experts as L0's autopin does
    (src/moe_l2/cache/heat.py; named "<policy>+autopin"), on the same sequences.
    layer_rows: ceilings given instead of learned (one per replayed layer, as `--l0-ceilings` sets them), run as
    the ceilings variants are, on every sequence and reported under each capacity alike.
    processes: clients taking turns token by token (take_turns); hints, prefetch and ceilings need one.
    record_bytes: one record's size, for bytes per token.
    warm: score the policies as restarted after the first `train` share (restarted), on the rest only."""
    _check_choices(traces, policy, compare, profile, hints, processes, prefetch, ceilings or layer_rows is not None)
    if warm and (hints or prefetch or ceilings or layer_rows is not None or autopin):
        raise ReplayError("--warm scores the policies alone: give it without --hints, --prefetch, --ceilings and "
                          "--autopin")
    layers = _checked_layers(traces, layers)
    sequences, trained_on = _split_training(order_sequences(traces.sequences, order, seed),
                                            bool(prefetch or ceilings or warm), train)
    plan, hint_stats = (None, None)
    if hints:
        try:
            plan, hint_stats = plan_hints(sequences, profile, hints)
        except PredictorError as exc:
            raise ReplayError(str(exc)) from None
    streams, sources = _streams(sequences, processes, layers)
    before = _streams(trained_on, processes, layers) if warm else None
    names = [policy] + [c for c in compare if c != policy] + (["min"] if belady else [])
    tasks = [Task(layer, n_slots, name, streams[layer], traces.n_experts, hints=plan if name == policy else None,
                  profile=profile if name == policy else None, prior=prior if name == policy else 0.0,
                  hint_share=hint_share, hint_prior=hint_prior, record_tokens=name in (policy, "lru"),
                  hint_lift=hint_lift, sources=sources, context=_before(streams, layer),
                  warm=(before[0][layer], before[1], _before(before[0], layer)) if before and name != "min" else None)
             for n_slots in slots for name in names for layer in layers]
    # The variants (ceilings, autopin) run the policy under test and L0's LRU.
    variants = list(dict.fromkeys((policy, "lru")))
    split_slots = _ceiling_slots(traces, trained_on, layers, slots, layer_rows) \
        if ceilings or layer_rows is not None else {}
    for n_slots, rows in split_slots.items():
        tasks += [Task(layer, n, name, streams[layer], traces.n_experts, point=n_slots, label=f"{name}+ceilings",
                       context=_before(streams, layer))
                  for name in variants for layer, n in zip(layers, rows)]
    if autopin:
        tasks += [Task(layer, n_slots, name, streams[layer], traces.n_experts, autopin_top_k=traces.top_k,
                       label=f"{name}+autopin", sources=sources, context=_before(streams, layer))
                  for n_slots in slots for name in variants for layer in layers]
    k = traces.top_k if prefetch_k is None else prefetch_k
    scores = _prefetch_tasks(traces, prefetch, k, trained_on, sequences, slots, layers, policy, streams, tasks)
    for extra, asked in (("ceilings", bool(split_slots)), ("autopin", autopin)):
        names += [f"{name}+{extra}" for name in variants] if asked else []
    tally = Tally(tasks, _run_tasks(tasks, jobs), names, policy, layers, streams, prefetch,
                  sum(s.n_tokens for s in sequences), _domain_starts(sequences, processes), switch_window,
                  record_bytes)
    return ReplayResult(
        traces=traces.paths, model=traces.model, n_layers=traces.n_layers, n_experts=traces.n_experts,
        top_k=traces.top_k, sequences=len(sequences), tokens=tally.n_tokens, order=order, seed=seed, policy=policy,
        compare=[n for n in names if n != policy], profile=profile.path if profile is not None else None,
        hints=hints, hint_stats=hint_stats, prior=prior, hint_share=hint_share, hint_prior=hint_prior,
        hint_lift=hint_lift, layers=layers, switch_window=switch_window, domain_switches=len(tally.starts),
        capacities=[tally.capacity(n_slots, traces.n_experts) for n_slots in slots], prefetch=list(prefetch),
        prefetch_k=k if prefetch else None,
        trained_on={"sequences": len(trained_on), "tokens": sum(s.n_tokens for s in trained_on)},
        ceilings=split_slots, autopin=autopin, prefetch_scores=scores, processes=processes,
        record_bytes=record_bytes, warm=warm)


def _streams(sequences: list, processes: int, layers: list[int]) -> tuple[dict, list | None]:
    """Per layer and the layer before each, the sequences' token batches in the order `processes` clients send
    them, and each token's client (None: one client)."""
    tokens, sources = ([token for s in sequences for token in s.experts], None) if processes == 1 else \
        take_turns(sequences, processes)
    wanted = sorted({*layers, *(layer - 1 for layer in layers if layer > 0)})
    return {layer: [tuple(token[layer]) for token in tokens] for layer in wanted}, sources


def _before(streams: dict, layer: int) -> list | None:
    """Each token's batch at the layer before `layer`: the context the learned policy weighs (None at the first)."""
    return streams.get(layer - 1)


def _check_choices(traces: TraceSet, policy: str, compare, profile: Profile | None, hints: str | None,
                   processes: int, prefetch: tuple[str, ...], ceilings: bool) -> None:
    if policy not in POLICIES:
        raise ReplayError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    for name in compare:
        if name not in POLICIES:
            raise ReplayError(f"unknown comparison policy {name!r}; choose from {', '.join(POLICIES)}")
    if profile is not None:
        profile.check_model(traces.n_layers, traces.n_experts, f"trace {traces.paths[0]}")
    if hints and profile is None:
        raise ReplayError("--hints needs --profile: the predictor and the domains' experts come from a profile")
    if processes < 1:
        raise ReplayError(f"--processes must be at least 1, got {processes}")
    if processes > 1 and (hints or prefetch or ceilings):
        raise ReplayError("--processes replays one client's tokens after another's: --hints, --prefetch and "
                          "--ceilings follow one client's sequences, so give them without --processes")
    for name in prefetch:
        if name not in REPLAY_PREDICTORS:
            raise ReplayError(f"unknown prefetch predictor {name!r}; choose from {', '.join(REPLAY_PREDICTORS)}")
    if prefetch and traces.n_layers < 2:
        raise ReplayError("--prefetch needs a trace of at least two MoE layers")


def _checked_layers(traces: TraceSet, layers: list[int] | None) -> list[int]:
    layers = list(range(traces.n_layers)) if layers is None else layers
    for layer in layers:
        if not 0 <= layer < traces.n_layers:
            raise ReplayError(f"layer {layer} out of range 0..{traces.n_layers - 1}")
    return layers


def _split_training(sequences: list, split: bool, train: float) -> tuple[list, list]:
    """The sequences scored and those learned from (the first `train` share, where something learns)."""
    if not split:
        return sequences, []
    if not 0 <= train < 1:
        raise ReplayError(f"--train is the share of sequences to learn from, in [0, 1); got {train}")
    at = round(train * len(sequences))
    if at >= len(sequences):
        raise ReplayError("--train leaves no sequence to score on: lower it or give more sequences")
    return sequences[at:], sequences[:at]


def _ceiling_slots(traces: TraceSet, trained_on: list, layers: list[int], slots: list[int],
                   layer_rows: list[int] | None) -> dict[int, list[int]]:
    """Per capacity, each replayed layer's slots: given (layer_rows), or split by the learned share's hit curves."""
    if layer_rows is not None:
        if len(layer_rows) != len(layers):
            raise ReplayError(f"{len(layer_rows)} layer ceilings for {len(layers)} replayed layers: give one per "
                              "layer")
        return {n_slots: list(layer_rows) for n_slots in slots}
    curves = sequence_curves(trained_on, layers, traces.n_experts)
    return {n_slots: split_rows(curves, n_slots * len(layers), min(traces.top_k, n_slots), traces.n_experts)
            for n_slots in slots}


def _prefetch_tasks(traces: TraceSet, prefetch: tuple[str, ...], k: int, trained_on: list, sequences: list,
                    slots: list[int], layers: list[int], policy: str, streams: dict, tasks: list) -> dict[str, Score]:
    """Score each next-layer predictor's guesses and add its replays (the policy under test, loading the guesses
    before each lookup) to `tasks`."""
    if not prefetch:
        return {}
    if k < 1:
        raise ReplayError(f"--prefetch-k must be at least 1, got {k}")
    routed = _routed(sequences)
    scores = {}
    for name in prefetch:
        guesses = guess_streams(name, trained_on, routed, traces.n_experts, k)
        score = Score()
        for layer in range(1, traces.n_layers):
            for guess, batch in zip(guesses[layer], routed[:, layer].tolist()):
                score.add(guess, batch)
        scores[name] = score
        tasks += [Task(layer, n_slots, policy, streams[layer], traces.n_experts, guesses=guesses[layer],
                       context=_before(streams, layer),
                       label=f"prefetch:{name}") for n_slots in slots for layer in layers]
    return scores


def _run_tasks(tasks: list[Task], jobs: int) -> list[dict]:
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=get_context("spawn")) as pool:
            return list(pool.map(replay_layer, tasks, chunksize=1))
    return [replay_layer(t) for t in tasks]


def _domain_starts(sequences: list, processes: int) -> list[int]:
    """Sequence starts that follow a sequence of another domain: the cold starts hints are meant for (one
    client's; none with several)."""
    starts, t, previous = [], 0, None
    for s in sequences if processes == 1 else ():
        if previous is not None and s.domain != previous:
            starts.append(t)
        previous = s.domain
        t += s.n_tokens
    return starts
