"""The memory governor: L2 gives memory back when the machine runs short, and takes it back later.

Every `interval` seconds it reads available memory (moe_l2.plan.read_memory; on Linux through a descriptor of
/proc/meminfo kept open from start, so that it still reads while a flood of connections fills the daemon's
descriptor table). Below the floor, every served model shrinks by as many slots per layer as the shortfall
pays for (at least one), evicting by policy and releasing the slots' pages (ServedModel.resize); never below
its pins. Once available memory is back above the floor by a quarter of the floor plus what a slot per layer
costs, the models grow back, one step per check, up to their configured slots (docs/architecture.md,
"Memory governor").
"""

from __future__ import annotations

import logging
import os
import threading

from moe_l2.plan import open_meminfo, read_memory
from moe_l2.sizes import format_size

from .served import ServedModel

log = logging.getLogger("moe-l2d.governor")

INTERVAL_S = 1.0


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
            per_slot = model.geometry.served * model.geometry.slot_stride  # served layers only
            capacity = min(s.capacity for s in model.stores.values())
            if memory.available < self.floor:
                step = max(1, -(-(self.floor - memory.available) // per_slot))
                if model.resize(capacity - step):
                    self.shrinks += 1
                    log.warning("available memory %s is below the floor %s: %s now holds %d slots per layer "
                                "(of %d); it grows back when memory recovers", format_size(memory.available),
                                format_size(self.floor), model.files.path,
                                min(s.capacity for s in model.stores.values()), model.geometry.n_slots)
            elif any(s.capacity < s.n_slots for s in model.stores.values()):
                spare = memory.available - self.floor - self.floor // 4
                step = spare // per_slot
                if step > 0 and model.resize(max(s.capacity for s in model.stores.values()) + step):
                    self.grows += 1
                    log.info("available memory %s: %s grows back to %d slots per layer (of %d)",
                             format_size(memory.available), model.files.path,
                             min(s.capacity for s in model.stores.values()), model.geometry.n_slots)

    def figures(self) -> dict:
        return {"total_bytes": self.total, "available_bytes": self.available, "floor_bytes": self.floor,
                "checks": self.checks,
                "shrinks": self.shrinks, "grows": self.grows}
