// Batch operations on records: the L3 file reads and their conversion (the L2 copy is SlotIndex's).
// They validate everything with the GIL held, then release it for the copying or reading.
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

// Reads are cut into units of at most this many bytes by default: one large record is read by
// several threads at once (SSDs want a deep queue). Callers that know their records pass their own
// (src/moe_l2/model/packed.py; docs/formats.md, "Direct I/O", has the measurement).
constexpr int64_t kReadUnitBytes = int64_t(8) << 20;

// (fd, file_offset, nbytes, dst, dst_offset): read nbytes of a file into dst.
using ReadJob = std::tuple<int, int64_t, int64_t, Memory*, int64_t>;

// Runs the reads on up to `threads` threads; raises the first failure once all have stopped.
// Files opened for direct I/O (O_DIRECT) are read in aligned blocks, through an aligned bounce
// buffer where the job is not aligned; a filesystem that refuses makes the fd buffered again.
void pread_records(const std::vector<ReadJob>& jobs, int threads, int64_t unit_bytes);

// (src_offset, nbytes, dst, dst_offset): bytes [src_offset, +nbytes) of a job's extent go to dst.
using ScatterPiece = std::tuple<int64_t, int64_t, Memory*, int64_t>;
// (fd, file_offset, nbytes, pieces): the extent read, its pieces copied out.
using ScatterJob = std::tuple<int, int64_t, int64_t, std::vector<ScatterPiece>>;

// One read per job (split into units across threads, one preadv a unit): straight into the pieces
// where the alignment of direct I/O allows (every piece on a buffered fd; pieces that lie in one memory
// as in the file as one range, the bytes between them included), the rest into aligned scratch memory
// and copied to its pieces as it lands: a packed record into an L0 row.
// With checksums, returns each job's CRC-32 over its pieces in order (record_checksum), computed by
// the read threads as the bytes land; else an empty list.
// With `landed` (a Memory of 4-byte words), once all of job j's bytes are in its pieces the word
// landed_at[j] becomes 1 (a release store) and landed_fd gets one byte, but for the last job to land,
// which the call returns with: the donor copies a record into L2 while the records after it are still
// read (client/donor.py).
std::vector<uint32_t> pread_scatter(const std::vector<ScatterJob>& jobs, int threads, int64_t unit_bytes,
                                    bool checksums, Memory* landed = nullptr,
                                    const std::vector<int64_t>& landed_at = {}, int landed_fd = -1);

// Turns direct I/O on or off for fd (O_DIRECT on Linux, F_NOCACHE on macOS). Returns whether
// reads now bypass the page cache: false where the filesystem or the platform has no direct I/O.
bool set_direct(int fd, bool enable);
// How many fds fell back to buffered reads because the filesystem refused a direct read.
int64_t direct_fallbacks();
// Test hook: the next n direct preads fail with EINVAL, as on a filesystem that refuses them.
void fail_direct_reads(int64_t n);
// Bench hook: false makes pread_scatter read every piece through its scratch and copy it (as it did
// before it read aligned pieces straight into their rows), to time both paths side by side.
void scatter_straight(bool enable);
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
