"""The memory governor: L2 gives memory back when the machine runs short, and takes it back later.

Every `interval` seconds it reads available memory (moe_l2.plan.read_memory; on Linux through a descriptor of
/proc/meminfo kept open from start, so that it still reads while a flood of connections fills the daemon's
descriptor table). Below the floor, every served model shrinks by as many slots per layer as the shortfall
pays for (at least one; pages still on their way back count as paid), evicting by policy (ServedModel.resize);
never below its pins. The taken slots' pages go back to the system RELEASE_GRACE_S later. Once available memory
is back above the floor by a quarter of the floor plus what a slot per layer costs, the models grow back, one
step per check, up to their configured slots, each slot only once its pages are reserved again; those that
cannot be (a full /dev/shm) are tried again at every check (docs/architecture.md, "Memory governor").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from moe_l2.plan import open_meminfo, read_memory
from moe_l2.sizes import format_size

from moe_l2.daemon.served import ServedModel

log = logging.getLogger("moe-l2d.governor")

INTERVAL_S = 1.0
# How long a taken slot's pages stay before they go back to the system: longer than a client reads a slot it
# looked up just before (a layer's evaluation on it in place, or a copy), since reading a released page where
# /dev/shm is full is a SIGBUS.
RELEASE_GRACE_S = 5.0


class Governor:
    def __init__(self, models: list[ServedModel], floor: int, interval: float = INTERVAL_S):
        self.models = models
        self.floor = floor
        self.interval = interval
        self.shrinks = 0
        self.grows = 0
        self.checks = 0
        self.available: int | None = None
        self.total: int | None = None
        self._meminfo = open_meminfo()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe-l2d-governor", daemon=True)

    def start(self) -> "Governor":
        self.check()  # the figures are there from the first stats on
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._meminfo is not None:
            os.close(self._meminfo)
            self._meminfo = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the daemon keeps serving at its current size
                log.exception("memory governor check failed")

    def check(self) -> None:
        memory = read_memory(self._meminfo)
        self.total, self.available = memory.total, memory.available
        self.checks += 1
        for model in self.models:
            model.release_due(time.monotonic() - RELEASE_GRACE_S)
            per_slot = model.geometry.served * model.geometry.slot_stride  # served layers only
            slots = Slots.of(model)
            was_unbacked = bool(model.unbacked)
            if memory.available < self.floor:
                shortfall = self.floor - memory.available - model.releasing_bytes
                step = -(-shortfall // per_slot)
                if step > 0 and model.resize(slots.fewest - step):
                    self.shrinks += 1
                    log.warning("available memory %s is below the floor %s: %s now holds %d slots per layer "
                                "(of %d); it grows back when memory recovers", format_size(memory.available),
                                format_size(self.floor), model.files.path, Slots.of(model).fewest,
                                model.geometry.n_slots)
            elif slots.short:
                spare = memory.available - self.floor - self.floor // 4
                step = spare // per_slot
                if step > 0 and model.resize(slots.most + step):
                    self.grows += 1
                    log.info("available memory %s: %s grows back to %d slots per layer (of %d)",
                             format_size(memory.available), model.files.path, Slots.of(model).fewest,
                             model.geometry.n_slots)
            if bool(model.unbacked) != was_unbacked:
                _log_unbacked(model)

    def figures(self) -> dict:
        return {"total_bytes": self.total, "available_bytes": self.available, "floor_bytes": self.floor,
                "checks": self.checks,
                "shrinks": self.shrinks, "grows": self.grows}


def _log_unbacked(model: ServedModel) -> None:
    """Once when slots cannot be backed, once when they all are again."""
    if model.unbacked:
        log.warning("%d slots of %s stay out of use: %s; they are tried again every %g s (moe-l2 stats and "
                    "moe-l2 doctor show them)", len(model.unbacked), model.files.path,
                    next(reversed(model.unbacked.values())), INTERVAL_S)
    else:
        log.info("every slot of %s is backed again", model.files.path)


@dataclass(frozen=True)
class Slots:
    """The fewest and the most slots a layer of a model holds now, and whether any layer holds fewer than it was
    configured with (layers may differ by a slot: Geometry.layer_slots)."""

    fewest: int
    most: int
    short: bool

    @classmethod
    def of(cls, model: ServedModel) -> "Slots":
        """In one walk of the model's stores."""
        fewest, most, short = None, 0, False
        for store in model.stores.values():
            fewest = store.capacity if fewest is None else min(fewest, store.capacity)
            most = max(most, store.capacity)
            short |= store.capacity < store.n_slots
        return cls(fewest or 0, most, short)
