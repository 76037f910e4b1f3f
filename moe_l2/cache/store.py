"""One MoE layer's slot store: which expert sits in which slot, pins, loads in flight, the policy.

Pure bookkeeping, no shared memory: the served model mirrors the decisions into the index segment, and
`moe-l2 replay` runs the same code over traces.
"""

from __future__ import annotations

from dataclasses import dataclass

FREE, LOADING, READY = 0, 1, 2


@dataclass(frozen=True)
class Reservation:
    slot: int
    expert: int
    evicted: int  # -1 when the slot was free


class LayerStore:
    def __init__(self, n_experts: int, n_slots: int, policy, pin_limit: int | None = None):
        if n_slots < 1:
            raise ValueError("a layer store needs at least one slot")
        self.n_experts = n_experts
        self.n_slots = n_slots
        self.policy = policy
        # Pins may take at most half the slots by default, so that demand misses always find room.
        self.pin_limit = max(1, n_slots // 2) if pin_limit is None else pin_limit
        self._slot_of: dict[int, int] = {}
        self._expert_in = [-1] * n_slots
        self._state = [FREE] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))
        self.pins: dict[str, set[int]] = {"permanent": set(), "domain": set()}
        self._pinned: set[int] = set()  # the union of the pin groups, kept up to date
        if hasattr(policy, "set_capacity"):
            policy.set_capacity(n_slots)

    def check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} out of range: this layer has experts 0..{self.n_experts - 1}")

    def slot(self, expert: int) -> int:
        """The slot holding a complete copy of the expert, or -1."""
        slot = self._slot_of.get(expert, -1)
        return slot if slot >= 0 and self._state[slot] == READY else -1

    def has(self, expert: int) -> bool:
        """Resident or on its way."""
        return expert in self._slot_of

    def pinned(self, expert: int) -> bool:
        return expert in self._pinned

    def access(self, expert: int, count: int = 1) -> None:
        self.policy.access(expert, count)

    def reserve(self, expert: int) -> Reservation | None:
        """Give the expert a slot to be loaded into; None if it has one or every slot is pinned or loading."""
        self.check_expert(expert)
        if expert in self._slot_of:
            return None
        if self._free:
            slot, evicted = self._free.pop(), -1
        else:
            state, pinned = self._state, self._pinned
            candidates = [e for e, s in self._slot_of.items() if state[s] == READY and e not in pinned]
            if not candidates:
                return None
            evicted = self.policy.victim(candidates)
            slot = self._slot_of.pop(evicted)
            self.policy.evict(evicted)
        self._slot_of[expert] = slot
        self._expert_in[slot] = expert
        self._state[slot] = LOADING
        return Reservation(slot, expert, evicted)

    def commit(self, reservation: Reservation) -> None:
        self._state[reservation.slot] = READY
        self.policy.insert(reservation.expert)

    def abort(self, reservation: Reservation) -> None:
        self._slot_of.pop(reservation.expert, None)
        self._expert_in[reservation.slot] = -1
        self._state[reservation.slot] = FREE
        self._free.append(reservation.slot)

    def pin(self, experts: list[int], kind: str) -> tuple[list[int], list[int]]:
        """Pin experts (they will not be evicted); returns (pinned, refused for lack of pin room)."""
        pinned, refused = [], []
        for expert in experts:
            self.check_expert(expert)
            if self.pinned(expert) or self.pin_count < self.pin_limit:
                self.pins[kind].add(expert)
                self._pinned.add(expert)
                pinned.append(expert)
            else:
                refused.append(expert)
        return pinned, refused

    def unpin(self, experts: list[int], kind: str) -> None:
        for expert in experts:
            self.check_expert(expert)
            self.pins[kind].discard(expert)
            if not any(expert in group for group in self.pins.values()):
                self._pinned.discard(expert)

    def set_domain_pins(self, experts: list[int], budget: int | None = None) -> list[int]:
        """Replace the domain pins (the active prediction) by the first `budget` of `experts` (best first)
        that the pin limit leaves room for; returns the experts pinned now, for the caller to load."""
        for expert in experts:
            self.check_expert(expert)
        self.unpin(sorted(self.pins["domain"]), "domain")
        room = self.pin_limit - self.pin_count
        budget = room if budget is None else max(0, min(budget, room))
        chosen = [e for e in dict.fromkeys(experts) if e not in self.pins["permanent"]][:budget]
        pinned, _ = self.pin(chosen, "domain")
        return pinned

    @property
    def pin_count(self) -> int:
        return len(self._pinned)

    @property
    def resident(self) -> int:
        return sum(1 for s in self._state if s == READY)

    @property
    def loading(self) -> int:
        return sum(1 for s in self._state if s == LOADING)

    def residents(self) -> list[int]:
        return sorted(e for e, s in self._slot_of.items() if self._state[s] == READY)
