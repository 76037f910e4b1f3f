"""Warm after a restart: each served model's heat saved in the state dir every SAVE_EVERY_S (longer for a large
heat: save_interval) and at a clean stop, restored and preloaded at the next start (docs/architecture.md, "Warm
after a restart").

What is kept of a model (daemon/heat_file.py): per served layer the experts held, hottest first by the policy
(with the records a preload had not reached yet), the pins and the policy's state; the active hint domain. At
start the policy states and pins are restored before the daemon serves, and the records are queued as one
Preload under every client's load (daemon/loader.py): each layer's pins first, then the hottest record of every
layer, the second of every layer, and so on, so that a client that comes early finds every layer's hottest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path

from moe_l2.atomic_file import open_dir
from moe_l2.cache.policy import restored_policy
from moe_l2.cache.store import PIN_KINDS
from moe_l2.sizes import format_size

from moe_l2.daemon.heat_file import Heat, HeatError, LayerHeat, file_name, max_bytes, read, write
from moe_l2.daemon.loader import Loader, Preload
from moe_l2.daemon.served import ServedModel

log = logging.getLogger("moe-l2d.warm")

# A crash loses at most this much of what L2 learned, or more where the heat is large: the saves write at most
# WRITE_BYTES_PER_S on average (the learned model of 256 experts a layer is hundreds of MiB; docs/decisions.md).
SAVE_EVERY_S = 180.0
WRITE_BYTES_PER_S = (1 << 30) / 3600


class WarmStart:
    """The heat of `models` in `directory`: restore() once before serving, start() the periodic saves, stop() at a
    clean stop (which saves once more)."""

    def __init__(self, directory: Path, models: list[ServedModel], loader: Loader):
        self.directory = directory
        self.models = models
        self.loader = loader
        self._dir_fd = self._open_dir()
        # Per fingerprint, a digest of the heat last written, its time left out: not a copy of the policies' state,
        # which is megabytes a layer for the learned model of a large one.
        self._written: dict[str, bytes] = {}
        self._failed: str | None = None  # the last save's failure, logged once until a save succeeds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe-l2d-heat", daemon=True)

    def _open_dir(self) -> int | None:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            return open_dir(self.directory)
        except OSError as exc:
            log.warning("cannot keep L2's heat in %s: %s; this daemon starts cold and saves no heat: give it a "
                        "directory it may write with --state-dir", self.directory, exc.strerror or exc)
            return None

    def restore(self) -> None:
        """Restore each model's saved heat and queue its preload. A model with no file starts cold; a file that
        is not taken (damaged, another model's, not the daemon's own) is named in one log line, and its model
        starts cold."""
        if self._dir_fd is None:
            return
        for model in self.models:
            name = file_name(model.files.fingerprint)
            g = model.geometry
            try:
                data = read(self._dir_fd, name, max_bytes(g.n_layers, g.n_experts))
                if data is None:
                    continue
                heat = Heat.decode(data, model.files.fingerprint, g.n_layers, g.n_experts)
                records = restore(model, heat)
            except HeatError as exc:
                log.warning("ignoring the heat file %s: %s; %s starts cold", self.directory / name, exc,
                            model.files.path)
                continue
            except Exception:  # a bug in the checks above must cost a warm start, never the daemon's start
                log.exception("ignoring the heat file %s; %s starts cold", self.directory / name, model.files.path)
                continue
            model.preload, model.heat_saved_at = Preload(model, records), heat.saved_at
            self.loader.preload(model.preload)
            kept = "" if heat.policy == model.policy else \
                f"; its {heat.policy} policy's state does not carry over to {model.policy}"
            log.info("warm start of %s: preloading %d records (%s) that L2 held at %s, below clients' loads%s",
                     model.files.path, len(records), format_size(len(records) * g.record_bytes),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(heat.saved_at)), kept)

    def start(self) -> None:
        if self._dir_fd is not None:
            self._thread.start()

    def _run(self) -> None:
        wait = SAVE_EVERY_S
        while not self._stop.wait(wait):
            wait = save_interval(self.save())

    def save(self) -> int:
        """Write each model's heat where it changed since the last write; a failure is logged once. Returns the
        bytes written."""
        written = 0
        if self._dir_fd is None:
            return written
        for model in self.models:
            heat = snapshot(model)
            digest = hashlib.blake2b(dataclasses.replace(heat, saved_at=0.0).encode(), digest_size=16).digest()
            if self._written.get(heat.fingerprint) == digest:
                continue
            name = file_name(heat.fingerprint)
            data = heat.encode()
            try:
                write(self.directory, self._dir_fd, name, data)
            except OSError as exc:
                problem = f"cannot save L2's heat to {self.directory / name}: {exc.strerror or exc}"
                if problem != self._failed:
                    log.warning("%s; the next start will be cold", problem)
                self._failed = problem
                continue
            self._written[heat.fingerprint] = digest
            self._failed = None
            written += len(data)
        return written

    def stop(self, save: bool) -> None:
        """Stop the periodic saves; save once more if `save` (a daemon that served: one whose start failed keeps
        the file it found)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if save:
            self.save()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


def save_interval(written: int) -> float:
    """The wait before the next save after one that wrote `written` bytes: SAVE_EVERY_S, longer where the heat is so
    large that saving it that often would write more than WRITE_BYTES_PER_S."""
    return max(SAVE_EVERY_S, written / WRITE_BYTES_PER_S)


def restore(model: ServedModel, heat: Heat) -> list[tuple[int, int]]:
    """Put `heat`'s policy states and pins into the model's stores, before it serves; returns the records to
    preload. Every policy state is checked before any store changes (HeatError: nothing changed). Layers the
    model does not serve now (--layers) are skipped; a policy changed since (--policy) starts afresh; the domain
    pins come back only with their domain, where the model's profile still knows it."""
    served = [h for h in heat.layers if h.layer in model.stores]
    policies = {}
    if heat.policy == model.policy:
        for h in served:
            try:
                policies[h.layer] = restored_policy(heat.policy, h.policy_state, heat.n_experts,
                                                    model.stores[h.layer].capacity)
            except ValueError as exc:
                raise HeatError(f"layer {h.layer}'s policy state: {exc}") from None
    domain = heat.active_domain if model.profile is not None and heat.active_domain in model.profile.domains \
        else None
    wanted = []
    with model.lock:
        for h in served:
            store = model.stores[h.layer]
            if h.layer in policies:
                store.adopt(policies[h.layer])
            for kind, experts in h.pins.items():
                if kind != "domain" or domain:
                    store.pin(list(experts), kind)
            pinned = [e for kind in PIN_KINDS for e in store.pins(kind)]
            wanted.append([(h.layer, e) for e in dict.fromkeys([*pinned, *h.experts])][:store.capacity])
        model.active_domain = domain
    return [record for rank in itertools.zip_longest(*wanted) for record in rank if record is not None]


def snapshot(model: ServedModel) -> Heat:
    """The model's heat now: each served layer's experts held (and those its preload has still to load), hottest
    first by the layer's policy, at most a slot each; its pins and policy state."""
    pending: dict[int, list[int]] = {}
    if model.preload is not None:
        for layer, expert in model.preload.untaken():
            pending.setdefault(layer, []).append(expert)
    layers = []
    for layer, store in model.stores.items():
        with model.lock:  # a layer at a time: a report waits for one layer's state at most
            held = store.policy.hottest({*store.held(), *pending.get(layer, ())})[:store.n_slots]
            pins = {kind: tuple(store.pins(kind)) for kind in PIN_KINDS if store.pins(kind)}
            layers.append(LayerHeat(layer, tuple(held), pins, store.policy.state()))
    domain = model.active_domain
    g = model.geometry
    return Heat(model.files.fingerprint, g.n_layers, g.n_experts, model.policy, time.time(), domain, tuple(layers))
