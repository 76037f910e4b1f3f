// Batch operations on records: the client's L2 -> L0 copy and the L3 file reads.
// Both validate everything with the GIL held, then release it for the copying or reading.
#pragma once

#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "memory.h"

namespace moe_l2 {

// Runs `loop` on this thread and up to n_threads - 1 more (each pulls work until none is left).
// Out of threads, the ones started and this one share the work.
template <typename Loop>
void run_on_threads(size_t n_threads, Loop&& loop) {
  std::vector<std::thread> pool;
  try {
    for (size_t t = 1; t < n_threads; ++t) {
      pool.emplace_back(loop);
    }
  } catch (const std::system_error&) {
  }
  loop();
  for (auto& t : pool) {
    t.join();
  }
}

// (src_off, nbytes, dst): one piece of a record and the pool memory whose rows receive it.
using CopyPiece = std::tuple<int64_t, int64_t, Memory*>;

// Seqlock-checked copy of records from the L2 shared-memory store, on up to `threads` threads.
// Result i is true iff the record of experts[i] was present and copied without a concurrent write
// (docs/architecture.md, "Native module": the reader side of the seqlock).
std::vector<bool> copy_records(const Memory& index, const Memory& data, int64_t slot_of_off,
                               int64_t meta_off, int64_t n_experts, int64_t n_slots,
                               int64_t slot_stride, const std::vector<CopyPiece>& pieces,
                               const std::vector<int64_t>& experts,
                               const std::vector<int64_t>& rows, int64_t threads);

// Records computed on in place (Segment.array, docs/architecture.md "Zero-copy L2 reads"), the reader
// side of the seqlock in two steps. lend_records: (slot, seq) of each expert that L2 holds and no
// writer is filling, slot -1 for the rest. records_unchanged: once the computation has read them,
// whether each lent slot's seq is still the one lent (true: the bytes read were the whole record).
std::vector<std::pair<int64_t, int64_t>> lend_records(const Memory& index, int64_t slot_of_off,
                                                      int64_t meta_off, int64_t n_experts,
                                                      int64_t n_slots,
                                                      const std::vector<int64_t>& experts);
std::vector<bool> records_unchanged(const Memory& index, int64_t meta_off, int64_t n_slots,
                                    const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& seqs);

// (fd, file_offset, nbytes, dst, dst_offset): read nbytes of a file into dst.
using ReadJob = std::tuple<int, int64_t, int64_t, Memory*, int64_t>;

// Runs the reads on up to `threads` threads; raises the first failure once all have stopped.
// Files opened for direct I/O (O_DIRECT) are read in aligned blocks, through an aligned bounce
// buffer where the job is not aligned; a filesystem that refuses makes the fd buffered again.
void pread_records(const std::vector<ReadJob>& jobs, int threads);

// (src_offset, nbytes, dst, dst_offset): bytes [src_offset, +nbytes) of a job's extent go to dst.
using ScatterPiece = std::tuple<int64_t, int64_t, Memory*, int64_t>;
// (fd, file_offset, nbytes, pieces): one read of the extent, then its pieces copied out.
using ScatterJob = std::tuple<int, int64_t, int64_t, std::vector<ScatterPiece>>;

// One read per job (split into units across threads), into aligned scratch memory, then the
// pieces are copied to their destinations: a packed record read in one go into pool rows.
void pread_scatter(const std::vector<ScatterJob>& jobs, int threads);

// Turns direct I/O on or off for fd (O_DIRECT on Linux, F_NOCACHE on macOS). Returns whether
// reads now bypass the page cache: false where the filesystem or the platform has no direct I/O.
bool set_direct(int fd, bool enable);
// How many fds fell back to buffered reads because the filesystem refused a direct read.
int64_t direct_fallbacks();
// Test hook: the next n direct preads fail with EINVAL, as on a filesystem that refuses them.
void fail_direct_reads(int64_t n);
// Bytes of [offset, offset + nbytes) of fd's file that are in the page cache (mincore); nbytes < 0: to the end.
int64_t page_cache_bytes(int fd, int64_t offset, int64_t nbytes);

// (type, rows, cols, src, src_offset, weight, weight_offset, scales, scales_offset, biases,
// biases_offset): one GGUF tensor of rows x cols elements, converted to MLX's layout. Float
// types (F32, F16, BF16) are copied to weight; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 become MLX
// affine quantization with group size 32 (uint32-packed weight, float16 scales and biases), byte
// for byte what mx.load gives for the types it reads; MXFP4 becomes MLX's "mxfp4" mode (packed
// weight, uint8 scales; biases unused).
using TranscodeJob = std::tuple<std::string, int64_t, int64_t, Memory*, int64_t, Memory*, int64_t, Memory*,
                                int64_t, Memory*, int64_t>;
void transcode_gguf(const std::vector<TranscodeJob>& jobs, int threads);

}  // namespace moe_l2
