// Batch operations on records: the client's L2 -> L0 copy and the L3 file reads.
// Both validate everything with the GIL held, then release it for the copying or reading.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include "memory.h"

namespace moe_l2 {

// (src_off, nbytes, dst): one piece of a record and the pool memory whose rows receive it.
using CopyPiece = std::tuple<int64_t, int64_t, Memory*>;

// Seqlock-checked copy of records from the L2 shared-memory store. Result i is true iff the
// record of experts[i] was present and copied without a concurrent write (see DESIGN.md).
std::vector<bool> copy_records(const Memory& index, const Memory& data, int64_t slot_of_off,
                               int64_t meta_off, int64_t n_experts, int64_t n_slots,
                               int64_t slot_stride, const std::vector<CopyPiece>& pieces,
                               const std::vector<int64_t>& experts,
                               const std::vector<int64_t>& rows);

// (fd, file_offset, nbytes, dst, dst_offset): read nbytes of a file into dst.
using ReadJob = std::tuple<int, int64_t, int64_t, Memory*, int64_t>;

// Runs the reads on up to `threads` threads; raises the first failure once all have stopped.
void pread_records(const std::vector<ReadJob>& jobs, int threads);

}  // namespace moe_l2
