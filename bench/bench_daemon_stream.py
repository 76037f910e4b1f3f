"""What moe-l2d's eviction policy sees in a `moe-l2 bench` run, recorded and replayed (issue 40).

`moe-l2 replay` scores a policy on the router's picks mixed as replay mixes them; moe-l2d's policy sees something
else: each client's L2 lookups (what its L0 missed), merged per report, cold at the daemon's start. This runs one
`moe-l2 bench` configuration (moe-l2 alone, once), records each layer's batches as the daemon's LayerStore observes
them (the experts, the client, the capacity then) and how many slots it reserved, then replays that stream through
the same LayerStore with LRU, Belady's MIN and the named policies at the daemon's capacity: hit rate, the share of
LRU's gap to MIN each closes over the run and in --parts equal parts of it (how soon a cold model pays), and the
daemon's own reservations beside the replayed misses of its policy (how closely the replay follows the daemon).

The recorder is a sitecustomize module put first on PYTHONPATH for the bench's processes (RECORDER below): it wraps
LayerStore's __init__, observe and reserve to write a line per call. Nothing of this is in the product.

    python bench/bench_daemon_stream.py --trace ../shared/traces/deepseek-v2-lite.jsonl.gz [--tokens 1440]
        [--processes 3] [--budget-share 50%] [--first-layers 6] [--parts 3] [--policies adaptive,learned]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from moe_l2.cache.policy import DEFAULT_POLICY, POLICIES
from moe_l2.cache.replay import Task, replay_layer
from moe_l2.cache.replay_results import gap_closed

RECORDER = r'''
import json, os
from moe_l2.cache import store

_out = open(os.path.join(os.environ["MOE_L2_STREAM_DIR"], f"{os.getpid()}.jsonl"), "w", buffering=1)
_ids = {}

def _record(name, line):
    inner = getattr(store.LayerStore, name)
    def recorded(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        _out.write(json.dumps(line(self, _ids.setdefault(id(self), len(_ids)), out, *args)) + "\n")
        return out
    setattr(store.LayerStore, name, recorded)

_record("__init__", lambda s, i, out, n_experts, n_slots, *a: ["store", i, n_experts, n_slots])
_record("observe", lambda s, i, out, experts, source=None: ["batch", i, [int(e) for e in experts], repr(source),
                                                            s.capacity])
_record("reserve", lambda s, i, out, *a: ["reserve", i, out is not None])
'''


@dataclass
class LayerStream:
    n_experts: int
    batches: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    capacities: list = field(default_factory=list)
    reserved: int = 0


def record(args, directory: Path) -> dict[int, LayerStream]:
    """Run the bench configuration with the recorder and read back the daemon's layers."""
    streams = directory / "stream"
    streams.mkdir()
    (directory / "sitecustomize.py").write_text(RECORDER)
    env = dict(os.environ, MOE_L2_STREAM_DIR=str(streams),
               PYTHONPATH=os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "moe_l2.cli", "bench", "--trace", str(args.trace), "--first-layers",
               str(args.first_layers), "--tokens", str(args.tokens), "--processes", str(args.processes),
               "--budget-share", args.budget_share, "--configs", "moe-l2", "--repeat", "1"]
    if subprocess.run(command, env=env).returncode:
        sys.exit("moe-l2 bench failed (its message is above): nothing was recorded")
    recorded = [read_stream(path) for path in sorted(streams.glob("*.jsonl"))]
    daemons = [layers for layers in recorded if any(s.batches for s in layers.values())]
    if len(daemons) != 1:
        sys.exit(f"expected one process with layer stores that saw batches (the daemon), found {len(daemons)}")
    return daemons[0]


def read_stream(path: Path) -> dict[int, LayerStream]:
    layers: dict[int, LayerStream] = {}
    clients: dict[str, int] = {}
    for line in path.read_text().splitlines():
        kind, store, *rest = json.loads(line)
        if kind == "store":
            layers[store] = LayerStream(rest[0])
        elif kind == "batch":
            experts, source, capacity = rest
            layer = layers[store]
            layer.batches.append(experts)
            layer.sources.append(clients.setdefault(source, len(clients)))
            layer.capacities.append(capacity)
        elif rest[0]:
            layers[store].reserved += 1
    return layers


def replay_stream(layers: dict[int, LayerStream], policies: list[str], parts: int) -> dict[str, dict]:
    """Hits per part and loads of each policy over every layer, at the capacity the daemon had most of the run."""
    totals = {name: {"hits": [0] * parts, "lookups": [0] * parts, "loads": 0} for name in policies}
    for index, layer in layers.items():
        if not layer.batches:
            continue
        slots = max(set(layer.capacities), key=layer.capacities.count)
        for name in policies:
            r = replay_layer(Task(index, slots, name, layer.batches, layer.n_experts, sources=layer.sources,
                                  record_tokens=True))
            hits = array("H")
            hits.frombytes(r["per_token"])
            total = totals[name]
            for t, (h, batch) in enumerate(zip(hits, layer.batches)):
                part = t * parts // len(layer.batches)
                total["hits"][part] += h
                total["lookups"][part] += len(batch)
            total["loads"] += r["loads"]
    return totals


def report(layers: dict[int, LayerStream], totals: dict[str, dict], parts: int) -> str:
    def closed(name: str, part: slice) -> str:
        gap = gap_closed(*(sum(totals[n]["hits"][part]) for n in (name, "lru", "min")))
        return "-" if gap is None else f"{100 * gap:.1f}%"

    batches = sum(len(layer.batches) for layer in layers.values())
    clients = max((len(set(layer.sources)) for layer in layers.values()), default=0)
    lines = [f"{len([l for l in layers.values() if l.batches])} layers, {batches} batches, {clients} clients; "
             f"the daemon reserved {sum(l.reserved for l in layers.values())} slots",
             "", "| policy | hit rate | replayed loads | gap closed | " + " | ".join(
                 f"part {p + 1} of {parts}" for p in range(parts)) + " |",
             "|---|---|---|---|" + "---|" * parts]
    for name, total in totals.items():
        rate = sum(total["hits"]) / max(1, sum(total["lookups"]))
        cells = [closed(name, slice(p, p + 1)) for p in range(parts)]
        lines.append(f"| {name} | {100 * rate:.1f}% | {total['loads']} | {closed(name, slice(None))} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=1440)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--budget-share", default="50%")
    parser.add_argument("--first-layers", type=int, default=6)
    parser.add_argument("--parts", type=int, default=3)
    parser.add_argument("--policies", default=f"adaptive,{DEFAULT_POLICY}",
                        help=f"compared beside lru and min; of {', '.join(POLICIES)}")
    args = parser.parse_args()
    policies = ["lru", "min"] + [p for p in args.policies.split(",") if p not in ("lru", "min")]
    unknown = [p for p in policies[2:] if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    with tempfile.TemporaryDirectory(prefix="moe-l2-stream-") as directory:
        layers = record(args, Path(directory))
    print(report(layers, replay_stream(layers, policies, args.parts), args.parts))


if __name__ == "__main__":
    main()
