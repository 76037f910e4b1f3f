#include <algorithm>
#include <atomic>
#include <cstring>

#include <nanobind/nanobind.h>

#include "records.h"

namespace nb = nanobind;

namespace moe_l2 {

namespace {

// Per-slot metadata in the index segment (docs/architecture.md, "Shared memory"):
// {int32 expert, uint32 seq, uint32 checksum, pad}.
constexpr size_t kMetaSize = 16;
constexpr size_t kMetaExpert = 0;
constexpr size_t kMetaSeq = 4;

struct Piece {
  size_t src_off;
  size_t nbytes;
  std::byte* dst;
};

// Records are copied in pieces of at most this many bytes, so that several threads share one large
// record (one core does not reach the machine's memory bandwidth; docs/architecture.md, "Native module").
constexpr size_t kChunk = size_t(1) << 20;

struct Chunk {
  const std::byte* src;
  std::byte* dst;
  size_t nbytes;
};

uint32_t load(const std::byte* p, int order) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(p), order);
}

// One layer's part of the index segment: where its expert -> slot map and its slot metadata lie.
struct IndexLayer {
  size_t slot_of_off, meta_off, n_experts, n_slots;
};

IndexLayer check_index(const char* fn, const Memory& index, int64_t slot_of_off, int64_t meta_off,
                       int64_t n_experts, int64_t n_slots) {
  IndexLayer at{to_size(fn, "slot_of_off", slot_of_off), to_size(fn, "meta_off", meta_off),
                to_size(fn, "n_experts", n_experts), to_size(fn, "n_slots", n_slots)};
  if (at.slot_of_off % 4 != 0 || at.meta_off % 4 != 0) {
    throw_value_error(fn, "slot_of_off and meta_off must be 4-byte aligned");
  }
  index.check_range(fn, at.slot_of_off, checked_mul(fn, at.n_experts, 4));
  index.check_range(fn, at.meta_off, checked_mul(fn, at.n_slots, kMetaSize));
  return at;
}

void check_expert(const char* fn, size_t i, int64_t expert, size_t n_experts) {
  if (expert < 0 || static_cast<size_t>(expert) >= n_experts) {
    throw_value_error(fn, "experts[" + std::to_string(i) + "] = " + std::to_string(expert) +
                              " is outside [0, " + std::to_string(n_experts) + ")");
  }
}

}  // namespace

std::vector<bool> copy_records(const Memory& index, const Memory& data, int64_t slot_of_off_in,
                               int64_t meta_off_in, int64_t n_experts_in, int64_t n_slots_in,
                               int64_t slot_stride_in, const std::vector<CopyPiece>& pieces_in,
                               const std::vector<int64_t>& experts,
                               const std::vector<int64_t>& rows, int64_t threads) {
  const char* fn = "copy_records";
  if (threads < 1) {
    throw_value_error(fn, "threads must be >= 1, got " + std::to_string(threads));
  }
  auto [slot_of_off, meta_off, n_experts, n_slots] =
      check_index(fn, index, slot_of_off_in, meta_off_in, n_experts_in, n_slots_in);
  size_t slot_stride = to_size(fn, "slot_stride", slot_stride_in);
  data.check_range(fn, 0, checked_mul(fn, n_slots, slot_stride));
  if (experts.size() != rows.size()) {
    throw_value_error(fn, "experts and rows differ in length (" + std::to_string(experts.size()) +
                              " != " + std::to_string(rows.size()) + ")");
  }
  size_t n_rows = 0;  // rows the destinations must have: 1 + the largest row
  for (size_t i = 0; i < experts.size(); ++i) {
    check_expert(fn, i, experts[i], n_experts);
    std::string what = "rows[" + std::to_string(i) + "]";
    n_rows = std::max(n_rows, checked_add(fn, to_size(fn, what.c_str(), rows[i]), 1));
  }

  // Hold every region, so that no segment can be unmapped while the GIL is released.
  auto index_region = index.region(fn);
  auto data_region = data.region(fn);
  std::vector<std::shared_ptr<Region>> dst_regions;
  std::vector<Piece> pieces;
  for (size_t p = 0; p < pieces_in.size(); ++p) {
    auto [src_off_in, nbytes_in, dst] = pieces_in[p];
    std::string what = "pieces[" + std::to_string(p) + "]";
    if (dst == nullptr) {
      throw_value_error(fn, what + " has no destination");
    }
    size_t src_off = to_size(fn, (what + " src_off").c_str(), src_off_in);
    size_t nbytes = to_size(fn, (what + " nbytes").c_str(), nbytes_in);
    if (checked_add(fn, src_off, nbytes) > slot_stride) {
      throw_value_error(fn, what + " [" + std::to_string(src_off) + ", " +
                                std::to_string(src_off + nbytes) + ") overruns the " +
                                std::to_string(slot_stride) + "-byte slot");
    }
    dst->check_range(fn, 0, checked_mul(fn, n_rows, nbytes));
    dst_regions.push_back(dst->region(fn, true));
    pieces.push_back({src_off, nbytes, dst_regions.back()->data});
  }

  const std::byte* idx = index_region->data;
  const std::byte* src = data_region->data;
  std::vector<bool> copied(experts.size(), false);
  {
    nb::gil_scoped_release unlocked;
    // Seqlock reader, split over threads: each present record's seq before any of its bytes are read,
    // the bytes in chunks on up to `threads` threads, then each seq again once every thread is done.
    std::vector<uint32_t> seq_before(experts.size(), 0);
    std::vector<const std::byte*> metas(experts.size(), nullptr);
    std::vector<Chunk> chunks;
    for (size_t i = 0; i < experts.size(); ++i) {
      auto expert = static_cast<int32_t>(experts[i]);
      auto slot = static_cast<int32_t>(load(idx + slot_of_off + 4 * size_t(expert), __ATOMIC_ACQUIRE));
      if (slot < 0 || static_cast<size_t>(slot) >= n_slots) {
        continue;
      }
      const std::byte* meta = idx + meta_off + kMetaSize * size_t(slot);
      uint32_t s1 = load(meta + kMetaSeq, __ATOMIC_ACQUIRE);
      if ((s1 & 1u) || static_cast<int32_t>(load(meta + kMetaExpert, __ATOMIC_RELAXED)) != expert) {
        continue;
      }
      seq_before[i] = s1;
      metas[i] = meta;
      const std::byte* record = src + size_t(slot) * slot_stride;
      for (const Piece& p : pieces) {
        for (size_t at = 0; at < p.nbytes; at += kChunk) {
          chunks.push_back({record + p.src_off + at, p.dst + size_t(rows[i]) * p.nbytes + at,
                            std::min(kChunk, p.nbytes - at)});
        }
      }
    }
    std::atomic<size_t> next{0};
    auto loop = [&] {
      for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) {
        std::memcpy(chunks[c].dst, chunks[c].src, chunks[c].nbytes);
      }
      // This thread's reads of record bytes are ordered before the seqs are read again (after the join).
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
    };
    // A few chunks are copied faster than threads start.
    size_t workers = chunks.size() >= 4 ? std::min(chunks.size(), size_t(threads)) : 1;
    run_on_threads(workers, loop);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (size_t i = 0; i < experts.size(); ++i) {
      copied[i] = metas[i] != nullptr && load(metas[i] + kMetaSeq, __ATOMIC_RELAXED) == seq_before[i];
    }
  }
  return copied;
}

std::vector<std::pair<int64_t, int64_t>> lend_records(const Memory& index, int64_t slot_of_off_in,
                                                      int64_t meta_off_in, int64_t n_experts_in,
                                                      int64_t n_slots_in,
                                                      const std::vector<int64_t>& experts) {
  const char* fn = "lend_records";
  auto [slot_of_off, meta_off, n_experts, n_slots] =
      check_index(fn, index, slot_of_off_in, meta_off_in, n_experts_in, n_slots_in);
  auto region = index.region(fn);
  const std::byte* idx = region->data;
  std::vector<std::pair<int64_t, int64_t>> lent;
  for (size_t i = 0; i < experts.size(); ++i) {
    check_expert(fn, i, experts[i], n_experts);
    auto expert = static_cast<int32_t>(experts[i]);
    auto slot = static_cast<int32_t>(load(idx + slot_of_off + 4 * size_t(expert), __ATOMIC_ACQUIRE));
    int64_t seq = 0;
    if (slot >= 0 && static_cast<size_t>(slot) < n_slots) {
      const std::byte* meta = idx + meta_off + kMetaSize * size_t(slot);
      uint32_t s = load(meta + kMetaSeq, __ATOMIC_ACQUIRE);
      if ((s & 1u) || static_cast<int32_t>(load(meta + kMetaExpert, __ATOMIC_RELAXED)) != expert) {
        slot = -1;
      }
      seq = s;
    } else {
      slot = -1;
    }
    lent.emplace_back(slot, seq);
  }
  return lent;
}

std::vector<bool> records_unchanged(const Memory& index, int64_t meta_off_in, int64_t n_slots_in,
                                    const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& seqs) {
  const char* fn = "records_unchanged";
  size_t meta_off = to_size(fn, "meta_off", meta_off_in);
  size_t n_slots = to_size(fn, "n_slots", n_slots_in);
  if (meta_off % 4 != 0) {
    throw_value_error(fn, "meta_off must be 4-byte aligned");
  }
  if (slots.size() != seqs.size()) {
    throw_value_error(fn, "slots and seqs differ in length (" + std::to_string(slots.size()) +
                              " != " + std::to_string(seqs.size()) + ")");
  }
  index.check_range(fn, meta_off, checked_mul(fn, n_slots, kMetaSize));
  auto region = index.region(fn);
  // Whatever read the records (a finished MLX evaluation) is ordered before these loads.
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  std::vector<bool> unchanged(slots.size(), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || static_cast<size_t>(slots[i]) >= n_slots) {
      throw_value_error(fn, "slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
                                " is outside [0, " + std::to_string(n_slots) + ")");
    }
    const std::byte* meta = region->data + meta_off + kMetaSize * size_t(slots[i]);
    unchanged[i] = load(meta + kMetaSeq, __ATOMIC_RELAXED) == static_cast<uint32_t>(seqs[i]);
  }
  return unchanged;
}

}  // namespace moe_l2
