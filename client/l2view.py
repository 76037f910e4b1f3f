"""Zero-copy L2 reads: MLX arrays over the daemon's shared memory, and loans of the slots a layer computes on.

A copy of a 2.5-13 MB record from L2 costs about what a page-cache read of it does, so an L2 hit that is
copied is not much of a hit. Instead, a layer can compute on the records where the daemon keeps them: per MoE
layer and record piece, one read-only array spans every slot of the layer's data segment (the slot stride is
its first stride, Segment.array), and the router's experts that L2 holds are looked up as slots of it (a Loan).
The daemon may refill a slot at any moment; it never waits for clients. So the loan keeps each slot's seqlock
sequence as it was before the computation, and once the layer's output is evaluated, `unchanged` says which
slots were not written meanwhile. A layer whose loan changed is computed again from L0 copies: a torn read
costs time, never a wrong weight (docs/architecture.md, "Zero-copy L2 reads").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from moe_l2.model.records import RecordLayout, row_strides


@dataclass(frozen=True)
class Loan:
    """Experts of one layer computed on in L2: their slots and the slots' sequences when lent."""

    view: "L2View"
    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    seqs: tuple[int, ...]

    def slot_of(self) -> dict[int, int]:
        return dict(zip(self.experts, self.slots))

    def arrays(self) -> dict[str, mx.array]:
        return self.view.arrays(self.layer)

    def torn(self) -> list[int]:
        """The lent experts whose slots were written since they were lent: call once the computation that
        read them is evaluated; its result is wrong if any is named."""
        return [e for e, ok in zip(self.experts, self.view.unchanged(self)) if not ok]

    def plus(self, other: "Loan") -> "Loan":
        """This loan and another of the same layer and view, as one."""
        return Loan(self.view, self.layer, self.experts + other.experts, self.slots + other.slots,
                    self.seqs + other.seqs)

    def __bool__(self) -> bool:
        return bool(self.experts)


class L2View:
    """Read-only MLX views of one daemon epoch's L2 (an Attachment), built per layer on first use."""

    def __init__(self, attachment, layout: RecordLayout):
        self.attachment = attachment
        self.layout = layout
        self._arrays: dict[int, dict[str, mx.array]] = {}

    @staticmethod
    def supported() -> bool:
        """Whether MLX computes on mapped memory in place here: Metal (no-copy buffers) or the CPU backend."""
        return mx.metal.is_available() or not mx.cuda.is_available()

    def arrays(self, layer: int) -> dict[str, mx.array]:
        """key -> array [slots, *piece shape] over the layer's data segment; row s is slot s's piece."""
        views = self._arrays.get(layer)
        if views is None:
            g = self.attachment.geometry
            data = self.attachment.data[layer]
            views = {}
            for p in self.layout.pieces:
                dtype = getattr(mx, p.dtype)
                views[p.key] = data.array(p.offset, [self.attachment.slots[layer], *p.shape],
                                          row_strides(g.slot_stride // dtype.size, p.shape), dtype)
            self._arrays[layer] = views
        return views

    def lend(self, layer: int, experts: list[int]) -> Loan:
        """The experts L2 holds whole now (the rest are absent or being written), as slots to compute on."""
        lent = self.attachment.slot_indexes[layer].lend(experts)
        held = [(e, slot, seq) for e, (slot, seq) in zip(experts, lent) if slot >= 0]
        return Loan(self, layer, *(tuple(column) for column in zip(*held))) if held else Loan(self, layer, (), (), ())

    def unchanged(self, loan: Loan) -> list[bool]:
        """Per lent expert: whether its slot was not written since it was lent (call once the computation
        that read it is evaluated)."""
        return self.attachment.slot_indexes[loan.layer].check(list(loan.slots), list(loan.seqs))
