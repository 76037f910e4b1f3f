"""`moe-l2 stats`: what the running daemon holds and how well it serves, for the people who run it; with
--watch, a live view whose rates come from successive stats replies."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from moe_l2.layout import describe_slots
from moe_l2.ranges import format_ranges
from moe_l2.model.location import socket_arg
from moe_l2.cache.score import prefetch_rates
from moe_l2.sizes import format_pct, format_size
from moe_l2.tiers import describe_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, type=socket_arg, help="daemon address (default: the local runtime dir)")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    parser.add_argument("--watch", action="store_true",
                        help="a live view: hit rates per tier, disk MB/s, loads, layers, clients, memory; Ctrl-C "
                             "ends it")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="seconds between --watch frames; rates are over this interval (default 1)")
    parser.add_argument("--count", type=int, default=None, metavar="N",
                        help="with --watch, stop after N frames (default: until Ctrl-C)")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


def _locking(d: dict) -> str:
    # A daemon from before locking (still running after an upgrade) does not report it.
    if "shm_locked_bytes" not in d:
        return ""
    return f" (locked {format_size(d['shm_locked_bytes'])}, unlocked {format_size(d['shm_unlocked_bytes'])})"


def _corrupt(m: dict) -> str:
    # Records that failed their checksum, never published (docs/architecture.md, "Integrity"); a daemon from
    # before checksums does not report them.
    if not m.get("corrupt_records"):
        return ""
    listed = ", ".join(f"{layer}/{expert}" for layer, expert in m["corrupt"])
    more = ", ..." if m["corrupt_records"] > len(m["corrupt"]) else ""
    return (f"  CORRUPT RECORDS {m['corrupt_records']} (layer/expert {listed}{more}; refused "
            f"{m['corrupt_loads']} loads: see the daemon log)")


def served(m: dict) -> str:
    """Which decoder layers the daemon serves of the model (moe-l2d --layers); a daemon from before --layers
    serves all and does not say."""
    ids = m.get("served_layer_ids")
    if ids is None or len(ids) == m["n_layers"]:
        return f"all {m['n_layers']} MoE layers served"
    return f"serves decoder layers {format_ranges(ids)}: {len(ids)} of {m['n_layers']} MoE layers"


def _slots_per_layer(m: dict) -> str:
    return describe_slots(m["slots_per_layer"], m.get("short_layers", 0))  # an older daemon does not say


def client_layers(c: dict) -> str:
    """The decoder layers an attached client said it streams, and those of them it reads from its files."""
    ids = c.get("layer_ids")
    if not ids:
        return "all layers"
    unserved = c.get("unserved_layer_ids")
    return f"layers {format_ranges(ids)}" + (f" ({format_ranges(unserved)} from its files)" if unserved else "")


def client_l0(c: dict) -> str:
    """The rows an attached client's L0 holds now, of the most it may hold (over all its layers)."""
    if c.get("l0_ceiling") is None:
        return "-"  # a client without a pool, or one from before it said
    return f"{c['l0_rows']}/{c['l0_ceiling']}"


def _layer_number(i: int, layer: dict) -> int:
    return layer.get("layer", i)  # the MoE layer; a daemon from before --layers lists every layer in order


def render(reply: dict) -> str:
    d = reply["daemon"]
    lines = [
        f"moe-l2d {d['version']}  pid {d['pid']}  up {d['uptime_s']:.0f} s  socket {d['socket']}",
        f"clients {d['clients']}  loads in flight {d['loads_in_flight']}  shared memory "
        f"{format_size(d['shm_bytes'])}{_locking(d)}  RSS {format_size(d['rss_bytes'])}  requests {d['requests']} "
        f"(refused {d['errors']})",
    ]
    memory = d.get("memory")  # a daemon from before the governor does not report it
    if memory and memory.get("available_bytes") is not None:
        lines.append(f"memory available {format_size(memory['available_bytes'])}, floor "
                     f"{format_size(memory['floor_bytes'])}: "
                     f"L2 shrunk {memory['shrinks']} times, grown back {memory['grows']} times")
    for m in reply["models"]:
        resident = sum(layer["resident"] for layer in m["layers"])
        slots = m["slots_per_layer"] * len(m["layers"]) - m.get("short_layers", 0)
        lines += [
            "",
            f"model {m['path']}  ({m['n_layers']} layers x {m['n_experts']} experts, "
            f"{_slots_per_layer(m)}, policy {m['policy']})",
            f"  {served(m)}",
            f"  hit rate {format_pct(m['hit_rate'])}  hits {m['hits']}  misses {m['misses']}  "
            f"served {format_size(m['served_bytes'])}  loaded {format_size(m['loaded_bytes'])}",
            *([f"  clients' lookups: {describe_sources(m['tiers'])}"] if m.get("tiers") else []),
            f"  loads done {m['loads_done']}  errors {m['load_errors']}{_corrupt(m)}  in flight "
            f"{m['loads_in_flight']}  latency p50 {_ms(m['load_latency_p50_s'])}  p99 {_ms(m['load_latency_p99_s'])}",
            *_prefetch(m),
            *_warm_start(m),
            *_fills(m, d.get("fills")),
            f"  occupancy {resident}/{slots} slots ({format_size(m['shm_bytes'])}"
            + (f", {format_size(m['released_bytes'])} given back to the system" if m.get("released_bytes") else "")
            + ")",
            *_unbacked(m),
            "  layer  resident  loading  pinned  slots in use  decoder layer",
        ]
        lines += [f"  {_layer_number(i, layer):5d}  {layer['resident']:8d}  {layer['loading']:7d}  "
                  f"{layer['pinned']:6d}  {layer.get('slots', m['slots_per_layer']):12d}  "
                  f"{layer.get('layer_id', '-'):>13}"
                  for i, layer in enumerate(m["layers"])]
    clients = d.get("client_list", [])
    if clients:
        lines += ["", "client  pid  idle  L0 rows  streams  lookups"]
        lines += [f"{c['name']}  {c['pid'] or '-'}  {c['idle_s']:.0f} s  {client_l0(c)}  {client_layers(c)}  "
                  f"{describe_sources(c['tiers']) if c.get('tiers') else '-'}" for c in clients]
    return "\n".join(lines)


def _unbacked(m: dict) -> list[str]:
    """Slots the governor could not take back (a daemon from before it: none)."""
    if not m.get("unbacked_slots"):
        return []
    return [f"  {m['unbacked_slots']} slots cannot be backed and stay out of use until they can: "
            f"{m['unbacked_error']}"]


def _prefetch(m: dict) -> list[str]:
    """The clients' next-layer prefetch, when any client reported one (a daemon from before: none)."""
    p = m.get("prefetch")
    if not p or not (p["issued"] or p["guessed"]):
        return []
    r = prefetch_rates(p)
    return [f"  prefetch (clients): guesses {format_pct(r['precision'])} precise, {format_pct(r['recall'])} "
            f"recall; {p['issued']} loaded ahead, {p['useful']} used, {p['wasted']} evicted unused; "
            f"stall hidden ~{_ms(r['hidden_s'])}"]


def _warm_start(m: dict) -> list[str]:
    """What the warm start preloaded of the heat saved before this start; nothing without one (no saved heat,
    --warm-start off, or a daemon from before)."""
    w = m.get("warm_start")
    if not w:
        return []
    try:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(w["saved_at"]))
    except (OverflowError, OSError, ValueError):  # no time a daemon of this release sends
        saved = f"{w['saved_at']!r} s since the epoch"
    going = f", {w['pending']} still to load" if w["pending"] else ""
    return [f"  warm start: preloaded {w['preloaded']} of {w['records']} records ({format_size(w['preloaded_bytes'])}) "
            f"that L2 held at {saved}{going}"]


def _fills(m: dict, desk: dict | None) -> list[str]:
    """What became of the misses clients read and gave to L2 (daemon/fills.py); nothing from a daemon without
    a fill desk (tcp://, or from before fills)."""
    fills = m.get("fills")
    if desk is None or fills is None:
        return []
    return [f"  fills: offered {fills['offered']}  donated {fills['donated']}  cancelled {fills['cancelled']}  "
            f"refused {fills['refused']}  reclaimed {fills['reclaimed']}  rejected {fills['rejected']}  "
            f"(donors {desk['donors']}, {desk['offers']} slots offered now, {desk['awaiting_exit']} gone quiet, "
            f"{desk['turned_away']} of other users turned away)"]


def _share(part: int, whole: int) -> str:
    return format_pct(part / whole if whole > 0 else None)


def model_rates(prev: dict | None, cur: dict, seconds: float) -> dict:
    """One model's figures over the interval between two stats replies (since start for the first). `tiers`:
    the clients' lookups by where their bytes came from (protocol.TIER_COUNTERS), None from a daemon from before
    them; `picks`, `l0`, `l2`, `l3`: the routers' picks, of which L2 had (`l2`), lacked (`l3`) and the rest."""
    def delta(key, p=prev, c=cur):
        return c[key] - (p[key] if p is not None else 0)

    tiers = None
    if "tiers" in cur:
        tiers = {k: n - (prev.get("tiers", {}).get(k, 0) if prev is not None else 0) for k, n in cur["tiers"].items()}
    hits, misses = delta("hits"), delta("misses")
    picks = max(delta("picks") if "picks" in cur else 0, hits + misses)
    layers = []
    earlier = {_layer_number(i, layer): layer for i, layer in enumerate(prev["layers"])} if prev is not None else {}
    for i, layer in enumerate(cur["layers"]):
        number = _layer_number(i, layer)
        before = earlier.get(number)
        h, m = delta("hits", before, layer), delta("misses", before, layer)
        layers.append({"layer": number, "slots": layer["slots"], "resident": layer["resident"],
                       "loading": layer["loading"], "pinned": layer["pinned"],
                       "hit_rate": h / (h + m) if h + m else None})
    return {"tiers": tiers, "picks": picks, "l0": picks - hits - misses, "l2": hits, "l3": misses,
            "disk_bytes_per_s": delta("loaded_bytes") / seconds if seconds > 0 else 0.0, "layers": layers}


def watch_frame(prev: dict | None, cur: dict, seconds: float):
    """The rich renderable of one --watch frame."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    d = cur["daemon"]
    memory = d.get("memory") or {}
    released = sum(m.get("released_bytes", 0) for m in cur["models"])
    available = memory.get("available_bytes")
    parts = [Text(f"moe-l2d {d['version']}  pid {d['pid']}  up {d['uptime_s']:.0f} s  {d['socket']}", style="bold"),
             Text(f"memory: available {'-' if available is None else format_size(available)}  floor "
                  f"{format_size(memory.get('floor_bytes') or 0)}  shared {format_size(d['shm_bytes'])}  released "
                  f"{format_size(released)}  daemon RSS {format_size(d['rss_bytes'])}")]
    span = "since start" if prev is None else f"last {seconds:.1f} s"
    for i, m in enumerate(cur["models"]):
        before = prev["models"][i] if prev is not None and i < len(prev["models"]) else None
        r = model_rates(before, m, seconds)
        parts.append(Text(""))
        parts.append(Text(f"{m['path']}  {m['n_layers']} layers x {m['n_experts']} experts, "
                          f"L2 {_slots_per_layer(m)}, policy {m['policy']}; {served(m)}",
                          style="bold"))
        lookups = (f"lookups {describe_sources(r['tiers'])}" if r["tiers"] is not None else
                   f"L0 {_share(r['l0'], r['picks'])}  L2 {_share(r['l2'], r['picks'])}  disk "
                   f"{_share(r['l3'], r['picks'])} of {r['picks']} picks")
        parts.append(Text(f"{span}: {lookups}  |  disk {r['disk_bytes_per_s'] / 1e6:.1f} MB/s  |  loads in flight "
                          f"{m['loads_in_flight']}"))
        table = Table("layer", "slots", "resident", "loading", "pinned", "L2 hit rate", box=None, padding=(0, 2))
        for layer in r["layers"]:
            table.add_row(str(layer["layer"]), str(layer["slots"]), str(layer["resident"]), str(layer["loading"]),
                          str(layer["pinned"]), format_pct(layer["hit_rate"]))
        parts.append(table)
    clients = Table("client", "pid", "idle", "L0 rows", "streams", "lookups since it attached",
                    title=f"{d['clients']} client(s) attached", title_justify="left", box=None, padding=(0, 2))
    for c in d.get("client_list", []):
        clients.add_row(c["name"], str(c["pid"] or "-"), f"{c['idle_s']:.0f} s", client_l0(c), client_layers(c),
                        describe_sources(c["tiers"]) if c.get("tiers") else "-")
    parts += [Text(""), clients]
    return Group(*parts)


class PipeClosed(Exception):
    """The reader of --watch's frames left (`moe-l2 stats --watch | head`): it has all it wanted."""


def pipe_closed() -> None:
    """rich's hook for a closed stdout (its own exits with status 1): point stdout at nothing, so that the exit's
    flush does not fail again, and end the watch."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise PipeClosed


def watch(args: argparse.Namespace, ask) -> int:
    """Frames every --interval seconds until --count or Ctrl-C (or SIGTERM); on a terminal a rich Live view
    redrawn in place, elsewhere (a pipe, a log) one frame after another."""
    from rich.console import Console
    from rich.live import Live
    from rich.rule import Rule

    if args.interval <= 0 or args.json:
        print("moe-l2 stats: --watch needs a positive --interval and no --json (use --json alone in scripts)",
              file=sys.stderr)
        return 2
    console = Console()
    console.on_broken_pipe = pipe_closed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    prev, prev_t, frames = None, None, 0
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while args.count is None or frames < args.count:
            if frames:
                time.sleep(args.interval)
            cur, now = ask(), time.monotonic()
            frame = watch_frame(prev, cur, now - prev_t if prev_t is not None else cur["daemon"]["uptime_s"])
            if live is not None:
                live.update(frame, refresh=True)
            else:
                console.print(frame)
                console.print(Rule())
            prev, prev_t, frames = cur, now, frames + 1
    except KeyboardInterrupt:
        pass
    except PipeClosed:
        pass
    finally:
        if live is not None:
            live.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    from moe_l2.control import UntrustedDaemon, stats

    def ask() -> dict:
        return stats(args.socket, args.timeout)  # the trust checks, a bounded reply, its shape checked

    try:
        if args.watch:
            return watch(args, ask)
        payload = ask()
    except (OSError, RuntimeError, UntrustedDaemon) as exc:
        # No answer, no socket or no permission, refused, an impostor, or a malformed reply.
        print(f"moe-l2 stats: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(payload, indent=2) if args.json else render(payload))
    return 0
