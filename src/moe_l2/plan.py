"""How one machine's memory is split between L2 (one copy per machine), each process' L0, the non-expert
weights and KV cache every process loads, and the OS (docs/architecture.md, "Budgets that size themselves").

The arithmetic only: `moe-l2d --budget auto`, the clients' default L0 and `moe-l2 plan` all call `plan`.
How many slots a budget buys stays with `moe_l2.layout.Geometry` (one owner per fact).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

import psutil

from moe_l2.layout import BudgetError, Geometry, record_stride
from moe_l2.sizes import format_size

GiB = 1 << 30
# Tests only: a JSON file {"total": bytes, "available": bytes} read instead of the machine's memory, where
# the machine cannot be made short of memory on purpose (docs/architecture.md, "Memory governor").
MEMORY_FILE_ENV = "MOE_L2_TEST_MEMORY"
DEFAULT_KV_BYTES = 1 * GiB  # per process: a few thousand tokens of context for the models we serve
# L0 may take at most this share of what is left after headroom, non-expert weights and KV: L2 is the one
# copy every process shares, so it gets the rest.
L0_SHARE = 0.5


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Memory:
    total: int
    available: int


def open_meminfo() -> int | None:
    """A descriptor of /proc/meminfo for `read_memory` to read again and again, on Linux (None elsewhere), so
    that a process whose descriptor table is full (a flood of connections) still reads its memory: procfs
    makes the file anew at every read from offset 0. The caller closes it."""
    return os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC) if sys.platform == "linux" else None


def read_memory(meminfo: int | None = None) -> Memory:
    """The machine's memory now, through `meminfo` (from `open_meminfo`) where given, which opens nothing. On
    macOS inactive pages count as available: the system hands them out on demand (as the daemon's budget
    check at start assumes, docs/architecture.md, "Shared memory"); there psutil asks the kernel, no file."""
    path = os.environ.get(MEMORY_FILE_ENV)
    if path:
        with open(path) as f:
            fake = json.load(f)
        return Memory(int(fake["total"]), int(fake["available"]))
    if meminfo is not None:
        # Lines like "MemAvailable:   24221600 kB"; the file is about 1.5 KiB. The same fields psutil reads.
        fields = {name: int(value.split()[0]) * 1024 for name, _, value in
                  (line.partition(b":") for line in os.pread(meminfo, 1 << 16, 0).splitlines())}
        return Memory(fields[b"MemTotal"], fields[b"MemAvailable"])
    vm = psutil.virtual_memory()
    extra = vm.inactive if sys.platform == "darwin" else 0
    return Memory(vm.total, vm.available + extra)


def os_headroom(total: int) -> int:
    """What the plan leaves to the OS and everything else on the machine: a tenth, at least 1 GiB."""
    return max(GiB, total // 10)


def default_floor(total: int) -> int:
    """The governor's floor of available memory when none is configured: a twentieth, at least 256 MiB."""
    return max(256 << 20, total // 20)


@dataclass(frozen=True)
class ModelSizes:
    n_layers: int
    n_experts: int
    top_k: int
    record_bytes: int
    non_expert_bytes: int  # what every process loads besides the experts (attention, embeddings, ...)
    l2_layers: int | None = None  # the MoE layers L2 serves (moe-l2d --layers); None: all

    @classmethod
    def of(cls, files, l2_layers: int | None = None) -> "ModelSizes":
        """From a `moe_l2.model.ModelFiles`: the non-expert bytes are the files' size less the records."""
        expert = files.n_layers * files.n_experts * files.layout.nbytes
        on_disk = sum(os.path.getsize(p) for p in files.files)
        return cls(files.n_layers, files.n_experts, files.top_k, files.layout.nbytes, max(0, on_disk - expert),
                   l2_layers)

    @property
    def expert_bytes(self) -> int:
        return self.n_layers * self.n_experts * self.record_bytes

    @property
    def l0_slot_bytes(self) -> int:
        """One L0 row in every layer: rows lie as L2's slots do, each record on a page (client/layerpool.py)."""
        return self.n_layers * record_stride(self.record_bytes)

    def l2_budget_for(self, slots: int) -> int:
        return Geometry.budget_for(self.n_layers, self.n_experts, self.record_bytes, slots, self.l2_layers)


# Plan's fields that are bytes (their JSON names end in _bytes).
_BYTES = ("total", "available", "os_headroom", "non_expert_per_process", "kv_per_process", "l0_per_process",
          "l2_budget")


@dataclass(frozen=True)
class Plan:
    total: int
    available: int
    processes: int
    os_headroom: int
    non_expert_per_process: int
    kv_per_process: int
    l0_slots: int           # experts per layer in each process' L0, or rows in all where l0_shared
    l0_per_process: int     # bytes
    l2_slots: int           # experts per layer in L2; 0 when nothing is left for it
    l2_budget: int          # bytes, for moe-l2d --budget
    l2_short: int           # the served layers that get one L2 slot fewer: the rest of the budget is spent
    n_experts: int
    l0_shared: bool         # one set of rows for all layers, beside an L2 computed on in place

    @property
    def l0_text(self) -> str:
        """What each process' L0 holds, as `moe-l2 plan` and moe-l2d's log say it."""
        where = "rows in all layers, shared" if self.l0_shared else "experts per layer"
        return f"L0 {self.l0_slots} {where} ({format_size(self.l0_per_process)})"

    def to_dict(self) -> dict:
        """`plan --json`'s "plan": the byte figures named by their unit."""
        return {f"{name}_bytes" if name in _BYTES else name: value for name, value in asdict(self).items()}


def default_l0_slots(model: ModelSizes) -> int:
    """The L0 a process gets when memory is plentiful: a quarter of the experts, at least twice a token's."""
    return min(model.n_experts, max(2 * model.top_k, model.n_experts // 4))


def shared_l0_rows(model: ModelSizes, pool: int, processes: int) -> int:
    """A shared L0's rows in all layers beside an L2 computed on in place: a token's top_k, which hold the misses
    being read and given to L2, and only what L2 cannot use beside them (every expert in it), up to the per-layer
    default in every layer: where memory is short, L0's copies of L2's records would cost L2 records
    (docs/benchmarks.md, "A shared L0's rows"); where it is not, an L0 hit costs less than an L2 loan."""
    per_slot = record_stride(model.record_bytes)
    spare = pool - model.l2_budget_for(model.n_experts) - processes * model.top_k * per_slot
    return model.top_k + min(max(0, spare) // (processes * per_slot),
                             default_l0_slots(model) * model.n_layers - model.top_k)


def plan(memory: Memory, model: ModelSizes, processes: int = 1, *, kv_bytes: int = DEFAULT_KV_BYTES,
         headroom: int | None = None, shared_l0: bool = True) -> Plan:
    """Split available memory: OS headroom first, then every process' non-expert weights and KV cache, then
    L0, then L2 (the rest, at most every expert). L0 is, with `shared_l0` (the clients of a daemon, computing on
    L2's records in place: the default), `shared_l0_rows` in all layers; else rows in every layer, at most
    `L0_SHARE` of the rest over all processes and never under top_k (docs/architecture.md, "Budgets that size
    themselves")."""
    if processes < 1:
        raise PlanError(f"processes must be at least 1, got {processes}")
    headroom = os_headroom(memory.total) if headroom is None else headroom
    pool = memory.available - headroom - processes * (model.non_expert_bytes + kv_bytes)
    if shared_l0:
        l0_slots, per_slot = shared_l0_rows(model, pool, processes), record_stride(model.record_bytes)
    else:
        per_slot = model.l0_slot_bytes
        affordable = max(0, int(pool * L0_SHARE)) // (processes * per_slot)
        l0_slots = max(model.top_k, min(default_l0_slots(model), affordable))
    rest = pool - processes * l0_slots * per_slot
    budget = min(rest, model.l2_budget_for(model.n_experts))
    try:
        l2 = Geometry.for_budget(model.n_layers, model.n_experts, model.record_bytes, budget, model.l2_layers)
    except BudgetError:
        l2 = None
    return Plan(memory.total, memory.available, processes, headroom, model.non_expert_bytes, kv_bytes,
                l0_slots, l0_slots * per_slot, l2.n_slots if l2 else 0, budget if l2 else 0,
                l2.n_short if l2 else 0, model.n_experts, shared_l0)
