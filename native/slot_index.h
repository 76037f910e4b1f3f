// The shared-memory slot format and its seqlock, defined here and nowhere else (docs/architecture.md,
// "Shared memory"). Per MoE layer the index segment holds slot_of (n_experts x int32: the slot holding
// the expert; -1 when absent; -(s + 2) while its record is coming into slot s) and the slots' metadata
// (n_slots x SlotMeta); the layer's data segment holds slot s's record at s * slot_stride.
// src/moe_l2/layout.py places the layers' parts and reads the sizes below from SlotIndex.SLOT_OF_BYTES and
// META_BYTES.
//
// The seqlock, writer side (the daemon, one writer per slot, all under its lock):
//   begin_fill   seq odd (compare-exchange), release fence, the evicted expert's slot_of -1, expert -1,
//                then the incoming expert's slot_of -(slot + 2), its waiters woken
//   (the record's bytes are written)
//   finish_fill  checksum, expert, seq even (release), then slot_of[expert] = slot (release), its waiters woken
//   abort_fill   seq even, the slot left empty (expert -1), the incoming expert's slot_of -1 (if it still
//                says coming into this slot), its waiters woken
// Reader side (clients, never blocking the writer): acquire loads of slot_of and seq, the slot's expert
// must be the one looked up and seq even; the bytes are read; an acquire fence; seq must be unchanged.
// copy does it all in one call; lend + check split it around a computation on the record in place. Any
// slot_of below 0 is absent to them. wait sleeps on a slot_of entry (native/word_wait.h) while it says the
// record is coming, and is only a wake-up: what arrived is read through the seqlock as always, and a writer
// that never wakes it costs the waiter its timeout, nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "memory.h"

namespace moe_l2 {

// One slot's metadata, as it lies in the index segment.
struct SlotMeta {
  int32_t expert;     // whose record the slot holds, -1 while empty or being filled
  uint32_t seq;       // the seqlock: odd while the slot is being filled, even when its record is whole
  uint32_t checksum;  // the record's (record_checksum), 0 where the model has no checksum manifest
  uint32_t reserved;
};
static_assert(sizeof(SlotMeta) == 16 && offsetof(SlotMeta, seq) == 4 && offsetof(SlotMeta, checksum) == 8,
              "the slot metadata is part of the shared-memory layout (moe_l2.layout.LAYOUT_VERSION)");

// One slot_of entry: an int32 slot number.
constexpr size_t kSlotOfBytes = sizeof(int32_t);

// (src_off, nbytes, dst, stride): bytes [src_off, src_off + nbytes) of a record, and the pool memory
// whose rows receive them, row r at r * stride.
using CopyPiece = std::tuple<int64_t, int64_t, Memory*, int64_t>;

// One MoE layer's slots: its part of the index segment and, where the layer is served, its data segment.
// Everything is bounds-checked once here; every operation takes the memory's region again, so a closed
// segment is an error, never a read of unmapped memory.
class SlotIndex {
 public:
  // data may be null (a layer the daemon does not serve): such an index can be cleared, not copied from.
  SlotIndex(Memory& index, Memory* data, int64_t slot_of_offset, int64_t meta_offset, int64_t n_experts,
            int64_t n_slots, int64_t slot_stride);

  // Writer side. Each returns the slot's new seq. begin_fill refuses a slot already being filled. incoming:
  // the expert whose record is coming into the slot (-1: none, the slot is only emptied), which abort_fill
  // names again.
  uint32_t begin_fill(int64_t slot, int64_t evicted, int64_t incoming);
  uint32_t finish_fill(int64_t slot, int64_t expert, uint32_t checksum);
  uint32_t abort_fill(int64_t slot, int64_t incoming);
  // Every expert absent and every slot empty: a new index's state before its first fill.
  void clear();

  // Reader side. copy: the records of experts into rows of the pieces' destinations, on up to `threads`
  // threads with the GIL released; result i is false where experts[i] is absent or was being filled
  // (its rows may then be partly written).
  std::vector<bool> copy(const std::vector<CopyPiece>& pieces, const std::vector<int64_t>& experts,
                         const std::vector<int64_t>& rows, int64_t threads) const;
  // (slot, seq) of each expert held whole now, slot -1 for the rest: records to compute on in place.
  std::vector<std::pair<int64_t, int64_t>> lend(const std::vector<int64_t>& experts) const;
  // Once whatever read the lent records is finished: whether each slot still has the seq it was lent with.
  std::vector<bool> check(const std::vector<int64_t>& slots, const std::vector<int64_t>& seqs) const;
  // Sleeps, with the GIL released, while each expert's record is coming into a slot (with `absent`, also
  // while it is absent and no fill of it has begun yet), until it is published, the fill ends without it, or
  // timeout_s (all of them together) has passed. Result i: whether experts[i] was coming or awaited.
  std::vector<bool> wait(const std::vector<int64_t>& experts, double timeout_s, bool absent) const;

  // What a slot_of entry and a slot's metadata hold now (acquire loads; for inspection and tests): a slot,
  // -1, or -(s + 2) for a record coming into slot s.
  int64_t slot_of(int64_t expert) const;
  std::tuple<int64_t, int64_t, int64_t> meta(int64_t slot) const;

  size_t n_experts() const { return n_experts_; }
  size_t n_slots() const { return n_slots_; }

 private:
  // `what`, or `what`[i] where i >= 0, names the argument in the error (built only then: these run per item).
  size_t check_slot(const char* fn, const char* what, int64_t slot, int64_t i = -1) const;
  size_t check_expert(const char* fn, const char* what, int64_t expert, int64_t i = -1) const;
  // copy's arguments: a data segment, threads >= 1, a valid expert and row for each record, and pieces that lie
  // in a slot and whose destinations hold every row named; ValueError (or the range's error) otherwise.
  void check_copy(const char* fn, const std::vector<CopyPiece>& pieces, const std::vector<int64_t>& experts,
                  const std::vector<int64_t>& rows, int64_t threads) const;

  Memory& index_;
  Memory* data_;
  size_t slot_of_off_, meta_off_, n_experts_, n_slots_, slot_stride_;
};

}  // namespace moe_l2
