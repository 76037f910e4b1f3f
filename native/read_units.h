// What the L3 reads share (pread_records in pread.cpp, pread_scatter in scatter.cpp): jobs cut into units
// that threads read with the GIL released, and direct I/O (O_DIRECT on Linux, F_NOCACHE on macOS) with
// aligned scratch memory and a buffered fallback where a filesystem refuses it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>
#include <sys/uio.h>

#include "memory.h"

namespace moe_l2 {

// Jobs are cut into units of at most unit_bytes (callers choose it: the queue depth a record's read
// gets is min(threads, record / unit_bytes)); no single pread nears the OS limits at the default.

// Direct reads use this alignment for file offsets, lengths and memory: the largest logical
// block size in common use (512 and 4096 both divide it). A filesystem that wants more makes
// the read fail with EINVAL, and the fd falls back to buffered reads.
constexpr size_t kDirectAlign = 4096;

inline size_t align_down(size_t v) { return v & ~(kDirectAlign - 1); }
inline size_t align_up(size_t v) { return (v + kDirectAlign - 1) & ~(kDirectAlign - 1); }
inline bool is_aligned(size_t v) { return (v & (kDirectAlign - 1)) == 0; }

// Aligned scratch memory (bounce buffers), from blocks cached between calls so that a miss does not pay
// for fresh pages every time. Empty (false) where there was no memory for it.
class Scratch {
 public:
  explicit Scratch(size_t nbytes);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::byte* data() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  std::byte* data_ = nullptr;
  size_t nbytes_ = 0;
};

// The file behind fd for error messages; best effort.
std::string fd_name(int fd);

struct FdState {
  int fd;
  std::atomic<bool> direct;
};

// One FdState per distinct fd of a call, so that a fallback seen by one thread holds for all.
class FdStates {
 public:
  FdState* get(int fd);

 private:
  std::vector<std::unique_ptr<FdState>> states_;
};

// The filesystem refused a direct read: read through the page cache from now on.
void fall_back_to_buffered(FdState& s);

// Reads up to the iovecs' total at off into them, in order; stops early only at the end of the
// file. Short reads continue where they stopped (iov is advanced past what was read), EINTR
// retries. Returns the bytes read, or -errno.
ssize_t preadv_full(int fd, std::vector<iovec>& iov, size_t off, bool direct);

// Read [file_offset, file_offset + nbytes) into dst; at least `need` bytes must exist in the file.
struct Unit {
  size_t job;
  FdState* fd;
  uint64_t file_offset;
  size_t nbytes;
  size_t need;
  std::byte* dst;
};

// A unit's read that returned `got` (bytes, or -errno): nothing if it has its `need` bytes.
std::optional<OsError> unit_result(const char* fn, const Unit& u, ssize_t got);

// Reads u into dst, through a bounce buffer where a direct read of it would not be aligned.
std::optional<OsError> read_unit(const char* fn, const Unit& u);

// Runs work(i) for i in [0, n) on up to `threads` threads with the GIL released; returns the
// first failure once every thread has stopped (no new item starts after a failure).
std::optional<OsError> run_parallel(size_t n, int threads,
                                    const std::function<std::optional<OsError>(size_t)>& work);

// Descriptors this thread's next reads (run_parallel) write one byte to once the GIL is released: threads a
// fetch has work for are woken while its reads run, not before, when they would take the GIL from it.
// Replaces what was set; flush_read_wakes writes what is still set now, and clears it.
void wake_when_reading(std::vector<int> fds);
void flush_read_wakes();
// One byte to a non-blocking fd; a full one already holds a wake-up.
void write_wake(int fd);

// ValueError unless threads >= 1 and unit_bytes a multiple of kDirectAlign up to 1 GiB.
void check_threads(const char* fn, int threads, int64_t unit_bytes);

}  // namespace moe_l2
