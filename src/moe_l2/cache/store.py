"""One MoE layer's slot store: which expert sits in which slot, pins, hints, loads in flight, the policy.

Pure bookkeeping, no shared memory: the daemon's served model mirrors the decisions into the index segment,
and `moe-l2 replay` runs the same code over traces. Only the store touches its pins, and `_pin_room` is the
one place that says how many more the pin limit allows (docs/architecture.md, "Policies, profiles and hints").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_l2.cache.policy import admits, latest, observe

if TYPE_CHECKING:
    from moe_l2.cache.profile import Profile

# OFF: a slot the daemon's memory governor took away (docs/architecture.md, "Memory governor").
FREE, LOADING, READY, OFF = 0, 1, 2, 3
# permanent: clients' pin requests; domain: a hint's; auto: replay's autopin.
PIN_KINDS = ("permanent", "domain", "auto")
# Domain pins take at most this share of a layer's slots (and never more than the store's pin limit).
HINT_PIN_SHARE = 0.25
# Only experts the domain picks at least this many times more often (by share) than the rest of the traffic
# are pinned: pinning experts that are hot everywhere only takes room from the sequence's own working set.
HINT_MIN_LIFT = 4.0
# A hint adds the domain's expert shares to the policy's scores with this strength (1: as much weight as
# the layer's whole decayed history), so the domain's experts win ties for the cache without being pinned.
HINT_PRIOR = 1.0


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
        self._pins: dict[str, set[int]] = {kind: set() for kind in PIN_KINDS}
        self._pinned: set[int] = set()  # the union of the pin groups, kept up to date
        self._off: list[int] = []  # slots taken away by shrink(), given back by grow()
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

    def observe(self, experts: list[int], source=None, context: list[int] | None = None) -> None:
        """Tell the policy of one batch of lookups (a token's in replay, a report's in the daemon) from `source`
        (the client that made them; None: the only one), and `context`, that client's latest at the layer before
        (None: unknown)."""
        observe(self.policy, experts, source, context)

    def latest(self, source=None) -> list[int] | None:
        """The client's latest batch here as the policy keeps it (None where it keeps none): the context of the
        layer after."""
        return latest(self.policy, source)

    def reserve(self, expert: int, keep: frozenset[int] = frozenset(), evict: bool = True,
                optional: bool = False) -> Reservation | None:
        """Give the expert a slot to be loaded into, never evicting one in `keep` (replay's prefetch keeps its
        other guesses), nor any with evict=False (a warm start's preload takes free slots only); None if it has
        one or no slot may be taken. optional: its reader computes on a copy of its own whether or not L2 takes
        it (a give), so the policy may keep its victim instead (`admits`), unless the expert is pinned."""
        self.check_expert(expert)
        if expert in self._slot_of:
            return None
        if self._free:
            slot, evicted = self._free.pop(), -1
        elif not evict:
            return None
        else:
            state, pinned = self._state, self._pinned
            candidates = [e for e, s in self._slot_of.items()
                          if state[s] == READY and e not in pinned and e not in keep]
            if not candidates:
                return None
            evicted = self.policy.victim(candidates)
            if optional and expert not in pinned and not admits(self.policy, expert, evicted):
                return None
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

    def adopt(self, policy) -> None:
        """Take `policy` (one restored from a saved state: moe_l2.cache.policy.restored_policy) in place of the
        store's own, before any access."""
        self.policy = policy
        self._capacity_changed()

    def pin(self, experts: list[int], kind: str) -> tuple[list[int], list[int]]:
        """Pin experts (they will not be evicted); returns (pinned, refused for lack of pin room)."""
        pinned, refused = [], []
        for expert in experts:
            self.check_expert(expert)
            if self.pinned(expert) or self._pin_room(self._pinned) > 0:
                self._pins[kind].add(expert)
                self._pinned.add(expert)
                pinned.append(expert)
            else:
                refused.append(expert)
        return pinned, refused

    def unpin(self, experts: list[int], kind: str) -> None:
        for expert in experts:
            self.check_expert(expert)
            self._pins[kind].discard(expert)
            if not any(expert in group for group in self._pins.values()):
                self._pinned.discard(expert)

    def pins(self, kind: str) -> list[int]:
        """The experts pinned as `kind` ("permanent", "domain", or "auto": replay's autopin), sorted."""
        return sorted(self._pins[kind])

    def _pin_room(self, staying: set[int]) -> int:
        """How many more experts the pin limit lets in beside `staying`, the pins that stay."""
        return max(0, self.pin_limit - len(staying))

    def hint_budget(self, share: float = HINT_PIN_SHARE) -> int:
        """How many domain pins a hint may take: a share of the slots, within the pin room that the
        permanent pins leave."""
        return max(0, min(self._pin_room(self._pins["permanent"]), int(share * self.n_slots)))

    def apply_hint(self, profile: Profile, domain: str | None, layer: int, *, share: float = HINT_PIN_SHARE,
                   prior: float = HINT_PRIOR, min_lift: float = HINT_MIN_LIFT) -> list[int]:
        """Point this store (MoE layer `layer` of the profile's model) at a domain: replace the domain pins by
        the domain's most frequent experts that are specific to it (lift >= `min_lift`, within
        `hint_budget`), and with `prior` > 0 add the domain's shares to the policy's scores. No domain (None
        or ""): release the domain pins. Returns the experts now domain-pinned; the caller loads the ones not
        resident. The daemon's hint and `moe-l2 replay --hints` both go through here."""
        wanted: list[int] = []
        if domain:
            budget = self.hint_budget(share)
            uniform = 1.0 / profile.n_experts
            shares = profile.shares(domain, layer)
            lift = profile.lift(domain, layer)
            # Only experts the domain uses more than uniformly are worth a pin.
            permanent = self._pins["permanent"]
            wanted = [e for e in profile.top_experts(domain, layer, profile.n_experts)
                      if shares[e] > uniform and e not in permanent and lift[e] >= min_lift][:budget]
            for expert in wanted:
                self.check_expert(expert)
        self.unpin(sorted(self._pins["domain"]), "domain")
        pinned, _ = self.pin(wanted, "domain")
        if domain and prior > 0 and hasattr(self.policy, "set_prior"):
            self.policy.set_prior(shares, prior)
        return pinned

    @property
    def capacity(self) -> int:
        """The slots in use: n_slots less those shrink() took away."""
        return self.n_slots - len(self._off)

    def shrink(self, target: int) -> list[Reservation]:
        """Take slots away until `target` remain, free ones first, then the policy's victims; never a pinned
        expert's slot, nor one being loaded, and always one slot beside the pins. Returns the slots taken
        (with the expert evicted, or -1); the caller clears them in shared memory and releases their pages."""
        target = max(target, min(self.n_slots, len(self._pinned) + 1))
        taken = []
        while self.capacity > target:
            if self._free:
                slot, evicted = self._free.pop(), -1
            else:
                candidates = [e for e, s in self._slot_of.items()
                              if self._state[s] == READY and e not in self._pinned]
                if not candidates:
                    break
                evicted = self.policy.victim(candidates)
                slot = self._slot_of.pop(evicted)
                self.policy.evict(evicted)
                self._expert_in[slot] = -1
            self._state[slot] = OFF
            self._off.append(slot)
            taken.append(Reservation(slot, -1, evicted))
        self._capacity_changed()
        return taken

    def off_slots(self, target: int) -> list[int]:
        """The slots shrink() took that grow() may give back to have `target` in use, the last taken first.
        The caller makes each usable first (the daemon reserves its pages again)."""
        return self._off[::-1][:max(0, target - self.capacity)]

    def grow(self, slots: list[int]) -> None:
        """Give back slots shrink() took (of off_slots)."""
        for slot in slots:
            self._off.remove(slot)
            self._state[slot] = FREE
            self._free.append(slot)
        self._capacity_changed()

    def _capacity_changed(self) -> None:
        if hasattr(self.policy, "set_capacity"):
            self.policy.set_capacity(self.capacity)

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

    def held(self) -> list[int]:
        """The experts resident or on their way."""
        return sorted(self._slot_of)
