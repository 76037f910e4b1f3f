"""The shared-memory layout of one served model, identical for the daemon (writer) and clients (readers).

Index segment:
    header   magic, layout version, epoch, fingerprint, geometry, one data-segment name per layer
    slot_of  per layer, n_experts x int32: the slot holding the expert, -1 when absent, -(s + 2) while its
             record is coming into slot s (clients wait on the entry: SlotIndex.wait)
    meta     per layer, n_slots x SlotMeta (the slot's expert, seq, checksum)
Data segment, one per served layer: its slots x slot_stride bytes; slot s holds one record at s * slot_stride.
A budget that does not divide evenly over the served layers gives the last `n_short` of them one slot fewer
than n_slots, so that none of it is left unspent.
The index covers every MoE layer; a layer the daemon does not serve (moe-l2d --layers) has no data segment
and an empty name in the header, and its slot_of stays -1 (docs/architecture.md, "Shared memory").

``seq`` is the slot's seqlock: odd while the daemon writes the slot, even when the record is whole. The slot_of
entries, the metadata and the seqlock's protocol are defined once, in native/slot_index.h: this module only
places each layer's part of the index (with the sizes moe_l2._native.SlotIndex gives), and `Geometry.slot_index`
hands a layer to it.
"""

from __future__ import annotations

import mmap
import random
import secrets
import struct
from dataclasses import dataclass

from moe_l2.sizes import format_size

MAGIC = b"MOEL2IDX"
LAYOUT_VERSION = 3  # 2: n_short, the served layers with one slot fewer; 3: records coming in, woken on slot_of
NAME_BYTES = 32
FINGERPRINT_BYTES = 64
MAX_SHM_NAME = 31  # macOS' PSHMNAMLEN; Linux allows more, but one name scheme must fit both
SEGMENT_PREFIX = "/ml2"
TOKEN_HEX = 10  # 40 random bits per segment name: too many names to take first, even by the million

# magic, layout version, n_layers, epoch, n_experts, n_slots, n_short, record_bytes, slot_stride, fingerprint,
# index name
_HEADER = struct.Struct(f"<8sIIQIIIQQ{FINGERPRINT_BYTES}s{NAME_BYTES}s")


def _slot_format():
    """moe_l2._native.SlotIndex, the owner of the slot format; imported on first use, so that commands that only
    describe slots (stats) do not load MLX."""
    from moe_l2 import _native

    return _native.SlotIndex


def align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def page_size() -> int:
    return mmap.PAGESIZE


def record_stride(record_bytes: int) -> int:
    """Bytes from one record to the next where records lie side by side in memory, each on a page: L2's slots,
    L0's rows (client/layerpool.py)."""
    return align(record_bytes, page_size())


def slot_range(n_slots: int, n_short: int) -> str:
    """'8', or '7-8' where the last layers hold one fewer."""
    return f"{n_slots - 1}-{n_slots}" if n_short else str(n_slots)


def describe_slots(n_slots: int, n_short: int) -> str:
    return f"{slot_range(n_slots, n_short)} slots per layer"


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Geometry:
    """Sizes of one model's segments; everything else follows from these. `n_served` of the `n_layers` MoE
    layers have a data segment (None: all of them); the budget pays for those only. The last `n_short` served
    layers hold n_slots - 1 slots, the others n_slots."""

    n_layers: int
    n_experts: int
    n_slots: int
    record_bytes: int
    n_served: int | None = None
    n_short: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.n_short < max(1, self.served) or (self.n_short and self.n_slots < 2):
            raise ValueError(f"{self.n_short} layers short of {self.n_slots} slots: no such geometry")

    @classmethod
    def for_budget(cls, n_layers: int, n_experts: int, record_bytes: int, budget: int,
                   n_served: int | None = None) -> "Geometry":
        """As many slots as the budget pays for (index segment included), at most one per expert of each served
        layer, spread over the served layers as evenly as they go: every slot the budget buys is used."""
        probe = cls(n_layers, n_experts, n_experts, record_bytes, n_served)
        total = min(n_experts * probe.served, max(0, budget - probe.index_bytes) // probe.slot_stride)
        if total < probe.served:
            raise BudgetError(f"budget {format_size(budget)} is too small: one slot per layer takes "
                              f"{format_size(probe.served * probe.slot_stride + probe.index_bytes)}; raise --budget")
        n_slots = -(-total // probe.served)
        return cls(n_layers, n_experts, n_slots, record_bytes, n_served, n_slots * probe.served - total)

    @classmethod
    def budget_for(cls, n_layers: int, n_experts: int, record_bytes: int, n_slots: int,
                   n_served: int | None = None) -> int:
        """The smallest budget that buys `n_slots` slots per served layer: the inverse of `for_budget`."""
        probe = cls(n_layers, n_experts, n_experts, record_bytes, n_served)  # for_budget's worst-case index
        return probe.index_bytes + n_slots * probe.served * probe.slot_stride

    @property
    def served(self) -> int:
        """The MoE layers with a data segment."""
        return self.n_layers if self.n_served is None else self.n_served

    @property
    def slot_stride(self) -> int:
        return record_stride(self.record_bytes)

    @property
    def slot_of_base(self) -> int:
        return align(_HEADER.size + self.n_layers * NAME_BYTES, 64)

    def slot_of_offset(self, layer: int) -> int:
        return self.slot_of_base + layer * self.n_experts * _slot_format().SLOT_OF_BYTES

    @property
    def meta_base(self) -> int:
        return align(self.slot_of_offset(self.n_layers), 64)

    def meta_offset(self, layer: int) -> int:
        return self.meta_base + layer * self.n_slots * _slot_format().META_BYTES

    def slot_index(self, index, layer: int, n_slots: int, data=None):
        """MoE `layer`'s slots in the index segment `index`, `n_slots` of them (the layer's own count,
        `layer_slots`), whose records lie in the segment `data` (None: an unserved layer): a
        moe_l2._native.SlotIndex, the seqlock's writer and reader sides."""
        return _slot_format()(index, data, slot_of_offset=self.slot_of_offset(layer),
                              meta_offset=self.meta_offset(layer), n_experts=self.n_experts, n_slots=n_slots,
                              slot_stride=self.slot_stride)

    @property
    def index_bytes(self) -> int:
        return align(self.meta_offset(self.n_layers), page_size())

    @property
    def total_slots(self) -> int:
        """The slots of every served layer together."""
        return self.n_slots * self.served - self.n_short

    def layer_slots(self, served) -> dict[int, int]:
        """Served MoE layer -> its slots: the last n_short in layer order hold one fewer. The daemon and its
        clients both ask this, so they agree on every layer's segment size."""
        served = sorted(served)
        if len(served) != self.served:
            raise ValueError(f"{len(served)} served layers, the geometry has {self.served}")
        return {layer: self.n_slots - (i >= self.served - self.n_short) for i, layer in enumerate(served)}

    def describe_slots(self) -> str:
        return describe_slots(self.n_slots, self.n_short)

    @property
    def shm_bytes(self) -> int:
        """The index segment and every served layer's data segment."""
        return self.index_bytes + self.total_slots * self.slot_stride


@dataclass(frozen=True)
class IndexHeader:
    geometry: Geometry
    epoch: int
    fingerprint: str
    index_name: str
    data_names: tuple[str, ...]

    @staticmethod
    def min_bytes(n_layers: int) -> int:
        """The fewest bytes an index segment of a model with n_layers MoE layers has: its header and data segment
        names (a client maps that much before it reads the geometry, which gives the whole size)."""
        return _HEADER.size + n_layers * NAME_BYTES

    def pack(self) -> bytes:
        g = self.geometry
        head = _HEADER.pack(MAGIC, LAYOUT_VERSION, g.n_layers, self.epoch, g.n_experts, g.n_slots, g.n_short,
                            g.record_bytes, g.slot_stride, self.fingerprint.encode(), self.index_name.encode())
        return head + b"".join(name.encode().ljust(NAME_BYTES, b"\0") for name in self.data_names)

    @classmethod
    def unpack(cls, buf) -> "IndexHeader":
        if len(buf) < _HEADER.size:
            raise ValueError("index segment is smaller than its header: not a moe-l2 segment")
        (magic, version, n_layers, epoch, n_experts, n_slots, n_short, record_bytes, slot_stride, fp,
         index_name) = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ValueError("index segment has a wrong magic: not a moe-l2 segment")
        if version != LAYOUT_VERSION:
            raise ValueError(f"index segment layout version {version}, this client reads {LAYOUT_VERSION}: "
                             "install the same moe-l2 release for the client and the daemon")
        names = []
        for layer in range(n_layers):
            raw = bytes(buf[_HEADER.size + layer * NAME_BYTES:_HEADER.size + (layer + 1) * NAME_BYTES])
            names.append(raw.rstrip(b"\0").decode())
        served = sum(map(bool, names))
        geometry = Geometry(n_layers, n_experts, n_slots, record_bytes, None if served == n_layers else served,
                            n_short)
        if geometry.slot_stride != slot_stride:
            raise ValueError(f"index segment slot stride {slot_stride} differs from this machine's "
                             f"{geometry.slot_stride} (page size {page_size()})")
        return cls(geometry, epoch, fp.rstrip(b"\0").decode(), index_name.rstrip(b"\0").decode(), tuple(names))


def segment_name(tag: str, model_index: int, layer: int | None, token: str) -> str:
    """The name of model `model_index`'s index segment (layer None) or of MoE `layer`'s data segment:
    '/ml2' + the daemon's tag (moe_l2.runtime.instance_tag) + a random token (new_token) + '.M' + 'i' or '.L'.

    The token, new for every segment at every start, is what no other user can guess and take first; the daemon
    finds what a crashed predecessor left in its segment list, and clients learn the names from the hello reply
    and the index header (docs/architecture.md, "Shared memory"). With 8 + 10 hex digits the longest, model 999's
    MoE layer 9999, is macOS' 31 characters."""
    name = f"{SEGMENT_PREFIX}{tag}{token}.{model_index}" + ("i" if layer is None else f".{layer}")
    if len(name) > MAX_SHM_NAME:
        raise ValueError(f"shared-memory name {name!r} exceeds {MAX_SHM_NAME} characters (macOS' limit): at most "
                         "1000 models and 10000 MoE layers per model")
    return name


def new_token(rng: random.Random | None = None) -> str:
    """TOKEN_HEX random hex digits from `secrets`; from `rng` where given (a seeded Random: names a test can
    repeat, which the daemon never passes)."""
    if rng is None:
        return secrets.token_hex(TOKEN_HEX // 2)
    return f"{rng.getrandbits(4 * TOKEN_HEX):0{TOKEN_HEX}x}"
