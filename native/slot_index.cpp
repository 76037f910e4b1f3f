#include "slot_index.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>

#include "records.h"
#include "word_wait.h"

namespace nb = nanobind;

namespace moe_l2 {

namespace {

// Records are copied in pieces of at most this many bytes, so that several threads share one large
// record (one core does not reach the machine's memory bandwidth; docs/decisions.md, "Large copies from L2
// run on several threads").
constexpr size_t kChunk = size_t(1) << 20;

struct Piece {
  size_t src_off;
  size_t nbytes;
  std::byte* dst;
  size_t stride;
};

struct Chunk {
  const std::byte* src;
  std::byte* dst;
  size_t nbytes;
};

// The index's words are shared with other processes: every access is atomic.
template <typename T>
T load(const T* p, int order) {
  return __atomic_load_n(p, order);
}

template <typename T>
void store(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

// The layer's parts of the index segment, inside one region of it.
struct Layer {
  std::byte* base;
  size_t slot_of_off, meta_off;

  int32_t* slot_of(size_t expert) const {
    return reinterpret_cast<int32_t*>(base + slot_of_off + kSlotOfBytes * expert);
  }
  SlotMeta* meta(size_t slot) const {
    return reinterpret_cast<SlotMeta*>(base + meta_off + sizeof(SlotMeta) * slot);
  }
};

// slot_of's value while a record is coming into `slot`, and back: any value below -1 says coming.
constexpr int32_t coming_into(size_t slot) { return -static_cast<int32_t>(slot) - 2; }
constexpr bool is_coming(int32_t slot_of) { return slot_of < -1; }

// The slot holding `expert` whole right now, and its (even) seq; slot -1 when it is absent, being
// filled, or slot_of names a slot that holds another expert (a fill in between the reader's loads).
std::pair<int32_t, uint32_t> find(const Layer& at, size_t n_slots, int32_t expert) {
  int32_t slot = load(at.slot_of(size_t(expert)), __ATOMIC_ACQUIRE);
  if (slot < 0 || static_cast<size_t>(slot) >= n_slots) {
    return {-1, 0};
  }
  const SlotMeta* meta = at.meta(size_t(slot));
  uint32_t seq = load(&meta->seq, __ATOMIC_ACQUIRE);
  if ((seq & 1u) || load(&meta->expert, __ATOMIC_RELAXED) != expert) {
    return {-1, seq};
  }
  return {slot, seq};
}

// `what` = value is outside [0, end), `what` named as what[i] where i >= 0.
[[noreturn]] void throw_outside(const char* fn, const char* what, int64_t i, int64_t value, size_t end) {
  std::string name = i < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(i) + "]";
  throw_value_error(fn, name + " = " + std::to_string(value) + " is outside [0, " + std::to_string(end) + ")");
}

}  // namespace

SlotIndex::SlotIndex(Memory& index, Memory* data, int64_t slot_of_offset, int64_t meta_offset,
                     int64_t n_experts, int64_t n_slots, int64_t slot_stride)
    : index_(index), data_(data) {
  const char* fn = "SlotIndex";
  slot_of_off_ = to_size(fn, "slot_of_offset", slot_of_offset);
  meta_off_ = to_size(fn, "meta_offset", meta_offset);
  n_experts_ = to_size(fn, "n_experts", n_experts);
  n_slots_ = to_size(fn, "n_slots", n_slots);
  slot_stride_ = to_size(fn, "slot_stride", slot_stride);
  if (slot_of_off_ % alignof(int32_t) != 0 || meta_off_ % alignof(SlotMeta) != 0) {
    throw_value_error(fn, "slot_of_offset and meta_offset must be 4-byte aligned");
  }
  if (n_experts_ > size_t(INT32_MAX) || n_slots_ > size_t(INT32_MAX)) {
    throw_value_error(fn, "n_experts and n_slots must fit an int32");
  }
  index.check_range(fn, slot_of_off_, checked_mul(fn, n_experts_, kSlotOfBytes));
  index.check_range(fn, meta_off_, checked_mul(fn, n_slots_, sizeof(SlotMeta)));
  if (data != nullptr) {
    data->check_range(fn, 0, checked_mul(fn, n_slots_, slot_stride_));
  }
}

size_t SlotIndex::check_slot(const char* fn, const char* what, int64_t slot, int64_t i) const {
  if (slot < 0 || static_cast<size_t>(slot) >= n_slots_) {
    throw_outside(fn, what, i, slot, n_slots_);
  }
  return size_t(slot);
}

size_t SlotIndex::check_expert(const char* fn, const char* what, int64_t expert, int64_t i) const {
  if (expert < 0 || static_cast<size_t>(expert) >= n_experts_) {
    throw_outside(fn, what, i, expert, n_experts_);
  }
  return size_t(expert);
}

// --- writer ----------------------------------------------------------------------------

uint32_t SlotIndex::begin_fill(int64_t slot_in, int64_t evicted, int64_t incoming) {
  const char* fn = "SlotIndex.begin_fill";
  size_t slot = check_slot(fn, "slot", slot_in);
  if (evicted != -1) {
    check_expert(fn, "evicted", evicted);
  }
  if (incoming != -1) {
    check_expert(fn, "incoming", incoming);
  }
  auto region = index_.region(fn, true);
  Layer at{region->data, slot_of_off_, meta_off_};
  SlotMeta* meta = at.meta(slot);
  uint32_t s = load(&meta->seq, __ATOMIC_RELAXED);
  if (s & 1u) {
    throw std::runtime_error(prefixed(fn, "slot " + std::to_string(slot) + " has an odd seq (" +
                                              std::to_string(s) +
                                              "): a fill is already in progress, or its writer died mid-fill"));
  }
  // A compare-exchange, so that two writers racing on one slot fail instead of both "owning" it.
  if (!__atomic_compare_exchange_n(&meta->seq, &s, s + 1, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    throw std::runtime_error(
        prefixed(fn, "slot " + std::to_string(slot) + "'s seq changed under a writer: two writers on one slot"));
  }
  // Readers must see the odd seq before any of the record bytes written after this call.
  __atomic_thread_fence(__ATOMIC_RELEASE);
  if (evicted >= 0) {
    store(at.slot_of(size_t(evicted)), int32_t(-1));
  }
  store(&meta->expert, int32_t(-1));
  if (incoming >= 0) {
    // After the odd seq: a reader that sees the record coming and then loads the seq finds it odd.
    int32_t* coming = at.slot_of(size_t(incoming));
    store(coming, coming_into(slot));
    wake_word(coming);  // those waiting for it to be looked for (ExpertPool's load-through)
  }
  return s + 1;
}

uint32_t SlotIndex::finish_fill(int64_t slot_in, int64_t expert, uint32_t checksum) {
  const char* fn = "SlotIndex.finish_fill";
  size_t slot = check_slot(fn, "slot", slot_in);
  check_expert(fn, "expert", expert);
  auto region = index_.region(fn, true);
  Layer at{region->data, slot_of_off_, meta_off_};
  SlotMeta* meta = at.meta(slot);
  uint32_t s = load(&meta->seq, __ATOMIC_RELAXED);
  if (!(s & 1u)) {
    throw std::runtime_error(prefixed(fn, "slot " + std::to_string(slot) + " is not being filled (seq " +
                                              std::to_string(s) + " is even): begin_fill first"));
  }
  store(&meta->checksum, checksum);
  store(&meta->expert, static_cast<int32_t>(expert));
  // The release store of the even seq orders the record's bytes and the metadata before it.
  store(&meta->seq, s + 1);
  // Published last: a reader that finds the slot through slot_of finds it whole.
  int32_t* published = at.slot_of(size_t(expert));
  store(published, static_cast<int32_t>(slot));
  wake_word(published);
  return s + 1;
}

uint32_t SlotIndex::abort_fill(int64_t slot_in, int64_t incoming) {
  const char* fn = "SlotIndex.abort_fill";
  size_t slot = check_slot(fn, "slot", slot_in);
  if (incoming != -1) {
    check_expert(fn, "incoming", incoming);
  }
  auto region = index_.region(fn, true);
  Layer at{region->data, slot_of_off_, meta_off_};
  SlotMeta* meta = at.meta(slot);
  uint32_t s = load(&meta->seq, __ATOMIC_RELAXED);
  if (!(s & 1u)) {
    throw std::runtime_error(prefixed(fn, "slot " + std::to_string(slot) + " is not being filled (seq " +
                                              std::to_string(s) + " is even): begin_fill first"));
  }
  // The slot stays empty (expert -1), so closing the seqlock publishes nothing.
  store(&meta->seq, s + 1);
  if (incoming >= 0) {
    int32_t* coming = at.slot_of(size_t(incoming));
    int32_t here = coming_into(slot);
    if (__atomic_compare_exchange_n(coming, &here, int32_t(-1), false, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
      wake_word(coming);  // its waiters read it themselves now
    }
  }
  return s + 1;
}

void SlotIndex::clear() {
  const char* fn = "SlotIndex.clear";
  auto region = index_.region(fn, true);
  Layer at{region->data, slot_of_off_, meta_off_};
  for (size_t e = 0; e < n_experts_; ++e) {
    store(at.slot_of(e), int32_t(-1));
  }
  for (size_t s = 0; s < n_slots_; ++s) {
    store(&at.meta(s)->expert, int32_t(-1));
  }
}

// --- readers ---------------------------------------------------------------------------

void SlotIndex::check_copy(const char* fn, const std::vector<CopyPiece>& pieces, const std::vector<int64_t>& experts,
                           const std::vector<int64_t>& rows, int64_t threads) const {
  if (data_ == nullptr) {
    throw_value_error(fn, "this layer has no data segment (the daemon does not serve it): read it from the file");
  }
  if (threads < 1) {
    throw_value_error(fn, "threads must be >= 1, got " + std::to_string(threads));
  }
  if (experts.size() != rows.size()) {
    throw_value_error(fn, "experts and rows differ in length (" + std::to_string(experts.size()) + " != " +
                              std::to_string(rows.size()) + ")");
  }
  size_t n_rows = 0;  // rows the destinations must have: 1 + the largest row
  for (size_t i = 0; i < experts.size(); ++i) {
    check_expert(fn, "experts", experts[i], int64_t(i));
    if (rows[i] < 0) {
      throw_value_error(fn, "rows[" + std::to_string(i) + "] must be >= 0, got " + std::to_string(rows[i]));
    }
    n_rows = std::max(n_rows, checked_add(fn, size_t(rows[i]), 1));
  }
  for (size_t p = 0; p < pieces.size(); ++p) {
    auto [src_off_in, nbytes_in, dst, stride_in] = pieces[p];
    std::string what = "pieces[" + std::to_string(p) + "]";
    if (dst == nullptr) {
      throw_value_error(fn, what + " has no destination");
    }
    size_t src_off = to_size(fn, (what + " src_off").c_str(), src_off_in);
    size_t nbytes = to_size(fn, (what + " nbytes").c_str(), nbytes_in);
    size_t stride = to_size(fn, (what + " stride").c_str(), stride_in);
    if (checked_add(fn, src_off, nbytes) > slot_stride_) {
      throw_value_error(fn, what + " [" + std::to_string(src_off) + ", " + std::to_string(src_off + nbytes) +
                                ") overruns the " + std::to_string(slot_stride_) + "-byte slot");
    }
    if (stride < nbytes) {
      throw_value_error(fn, what + ": rows " + std::to_string(stride) + " bytes apart cannot hold " +
                                std::to_string(nbytes) + " bytes each");
    }
    if (n_rows > 0) {
      dst->check_range(fn, checked_mul(fn, n_rows - 1, stride), nbytes);
    }
  }
}

std::vector<bool> SlotIndex::copy(const std::vector<CopyPiece>& pieces_in, const std::vector<int64_t>& experts,
                                  const std::vector<int64_t>& rows, int64_t threads) const {
  const char* fn = "SlotIndex.copy";
  check_copy(fn, pieces_in, experts, rows, threads);
  // Hold every region, so that no segment can be unmapped while the GIL is released.
  auto index_region = index_.region(fn);
  auto data_region = data_->region(fn);
  std::vector<std::shared_ptr<Region>> dst_regions;
  std::vector<Piece> pieces;
  for (const auto& [src_off, nbytes, dst, stride] : pieces_in) {
    dst_regions.push_back(dst->region(fn, true));
    pieces.push_back({size_t(src_off), size_t(nbytes), dst_regions.back()->data, size_t(stride)});
  }

  Layer at{index_region->data, slot_of_off_, meta_off_};
  const std::byte* src = data_region->data;
  std::vector<bool> copied(experts.size(), false);
  {
    nb::gil_scoped_release unlocked;
    // Split over threads: each present record's seq before any of its bytes are read, the bytes in
    // chunks on up to `threads` threads, then each seq again once every thread is done.
    std::vector<uint32_t> seq_before(experts.size(), 0);
    std::vector<const SlotMeta*> metas(experts.size(), nullptr);
    std::vector<Chunk> chunks;
    for (size_t i = 0; i < experts.size(); ++i) {
      auto [slot, seq] = find(at, n_slots_, static_cast<int32_t>(experts[i]));
      if (slot < 0) {
        continue;
      }
      seq_before[i] = seq;
      metas[i] = at.meta(size_t(slot));
      const std::byte* record = src + size_t(slot) * slot_stride_;
      for (const Piece& p : pieces) {
        for (size_t off = 0; off < p.nbytes; off += kChunk) {
          chunks.push_back({record + p.src_off + off, p.dst + size_t(rows[i]) * p.stride + off,
                            std::min(kChunk, p.nbytes - off)});
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
      copied[i] = metas[i] != nullptr && load(&metas[i]->seq, __ATOMIC_RELAXED) == seq_before[i];
    }
  }
  return copied;
}

std::vector<std::pair<int64_t, int64_t>> SlotIndex::lend(const std::vector<int64_t>& experts) const {
  const char* fn = "SlotIndex.lend";
  for (size_t i = 0; i < experts.size(); ++i) {
    check_expert(fn, "experts", experts[i], int64_t(i));
  }
  auto region = index_.region(fn);
  Layer at{region->data, slot_of_off_, meta_off_};
  std::vector<std::pair<int64_t, int64_t>> lent;
  lent.reserve(experts.size());
  for (int64_t expert : experts) {
    auto [slot, seq] = find(at, n_slots_, static_cast<int32_t>(expert));
    lent.emplace_back(slot, seq);
  }
  return lent;
}

std::vector<bool> SlotIndex::check(const std::vector<int64_t>& slots, const std::vector<int64_t>& seqs) const {
  const char* fn = "SlotIndex.check";
  if (slots.size() != seqs.size()) {
    throw_value_error(fn, "slots and seqs differ in length (" + std::to_string(slots.size()) + " != " +
                              std::to_string(seqs.size()) + ")");
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(fn, "slots", slots[i], int64_t(i));
  }
  auto region = index_.region(fn);
  Layer at{region->data, slot_of_off_, meta_off_};
  // Whatever read the records (a finished MLX evaluation) is ordered before these loads.
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  std::vector<bool> unchanged(slots.size(), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    unchanged[i] = load(&at.meta(size_t(slots[i]))->seq, __ATOMIC_RELAXED) == static_cast<uint32_t>(seqs[i]);
  }
  return unchanged;
}

std::vector<bool> SlotIndex::wait(const std::vector<int64_t>& experts, double timeout_s, bool absent) const {
  const char* fn = "SlotIndex.wait";
  for (size_t i = 0; i < experts.size(); ++i) {
    check_expert(fn, "experts", experts[i], int64_t(i));
  }
  if (!(timeout_s >= 0)) {
    throw_value_error(fn, "timeout_s must be >= 0, got " + std::to_string(timeout_s));
  }
  auto region = index_.region(fn);  // held: the mapping stays while the GIL is released
  Layer at{region->data, slot_of_off_, meta_off_};
  std::vector<bool> waited(experts.size(), false);
  {
    nb::gil_scoped_release unlocked;
    using clock = std::chrono::steady_clock;
    auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                       std::chrono::duration<double>(std::min(timeout_s, 86400.0)));
    for (size_t i = 0; i < experts.size(); ++i) {
      const int32_t* word = at.slot_of(size_t(experts[i]));
      bool began = false;  // seen coming: once it is absent again, its fill ended without it
      for (;;) {
        int32_t now = load(word, __ATOMIC_ACQUIRE);
        began = began || is_coming(now);
        if (!(is_coming(now) || (absent && now == -1 && !began))) {
          break;
        }
        waited[i] = true;
        auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - clock::now()).count();
        if (left <= 0) {
          break;
        }
        wait_on_word(word, now, left);
      }
    }
  }
  return waited;
}

int64_t SlotIndex::slot_of(int64_t expert) const {
  const char* fn = "SlotIndex.slot_of";
  size_t e = check_expert(fn, "expert", expert);
  auto region = index_.region(fn);
  return load(Layer{region->data, slot_of_off_, meta_off_}.slot_of(e), __ATOMIC_ACQUIRE);
}

std::tuple<int64_t, int64_t, int64_t> SlotIndex::meta(int64_t slot) const {
  const char* fn = "SlotIndex.meta";
  size_t s = check_slot(fn, "slot", slot);
  auto region = index_.region(fn);
  const SlotMeta* m = Layer{region->data, slot_of_off_, meta_off_}.meta(s);
  uint32_t seq = load(&m->seq, __ATOMIC_ACQUIRE);
  return {load(&m->expert, __ATOMIC_RELAXED), seq, load(&m->checksum, __ATOMIC_RELAXED)};
}

}  // namespace moe_l2
