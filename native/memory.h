// Byte ranges the native module copies into and out of: C++-owned buffers that back MLX
// arrays, plain host memory, and mapped POSIX shared-memory segments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <mlx/array.h>

namespace moe_l2 {

// An OS call failed: becomes an OSError (or the errno's subclass) carrying `err`.
// err == 0 means "no errno" (e.g. an unexpected end of file).
struct OsError : std::runtime_error {
  OsError(int err, const std::string& what) : std::runtime_error(what), err(err) {}
  int err;
};

// "[fn] " + msg, the prefix every error of the module carries.
std::string prefixed(const char* fn, const std::string& msg);
[[noreturn]] void throw_value_error(const char* fn, const std::string& msg);

// a + b and a * b, or a ValueError when they overflow.
size_t checked_add(const char* fn, size_t a, size_t b);
size_t checked_mul(const char* fn, size_t a, size_t b);

// A non-negative Python int as a size, or a ValueError naming `what`.
size_t to_size(const char* fn, const char* what, int64_t v);

// Bytes that stay valid while anyone holds the shared_ptr: a Memory object, a memoryview
// exported from it, or a native call running with the GIL released.
struct Region {
  virtual ~Region() = default;
  std::byte* data = nullptr;
  size_t nbytes = 0;
};

class Memory {
 public:
  virtual ~Memory() = default;
  Memory(Memory&&) = default;
  Memory& operator=(Memory&&) = default;

  size_t nbytes() const { return nbytes_; }
  bool readonly() const { return readonly_; }
  uintptr_t address(const char* fn) const;

  // The bytes, kept alive by the returned handle. ValueError once closed, and when
  // `writable` is asked of read-only memory.
  std::shared_ptr<Region> region(const char* fn, bool writable = false) const;
  // Checks that [offset, offset + nbytes) lies inside the memory.
  void check_range(const char* fn, size_t offset, size_t nbytes) const;

  uint32_t load_u32(size_t off) const;
  int32_t load_i32(size_t off) const;
  void store_u32(size_t off, uint32_t v);
  void store_i32(size_t off, int32_t v);

  // "buffer" or "segment '/name'", for error messages.
  virtual std::string describe() const = 0;

 protected:
  Memory(std::shared_ptr<Region> region, bool readonly)
      : region_(std::move(region)), nbytes_(region_->nbytes), readonly_(readonly) {}

  std::shared_ptr<Region> region_;  // null once closed

 private:
  uint32_t* word(const char* fn, size_t off, bool writable) const;

  size_t nbytes_;
  bool readonly_;
};

// Gives the 2 MiB-aligned part of [data, data + nbytes) fresh pages (what it held is dropped: zero on
// the next touch), transparent huge pages where Linux has them; elsewhere (macOS), and where the
// kernel says no, the pages stay small. Only for private memory the caller owns. A direct read
// into huge pages is one physically contiguous run per 2 MiB: on a VM whose disk emulation handles
// each run apart that reads up to 3.8x faster (docs/benchmarks.md, "Straight into the rows").
void fresh_huge_pages(void* data, size_t nbytes);
// The size of the pages fresh_huge_pages asks for (2 MiB on Linux), 0 where it does nothing.
size_t huge_page_bytes();
// Test hook: Segment::prefault touches every page, as on macOS, instead of asking Linux to map them.
void prefault_by_touch(bool enable);
// memcpy with stores that bypass the cache on x86-64 (SSE2's, which every x86-64 has): a record copied into L2 is
// not read again by this thread soon, and a cached store first reads each line it writes
// (docs/benchmarks.md, "The donor's copy past the cache"). memcpy elsewhere (arm64: not measured).
void copy_past_cache(std::byte* dst, const std::byte* src, size_t nbytes);

// C++-owned memory allocated by MLX's own allocator, so that arrays made from it are views
// that MLX ops (CPU, Metal, CUDA) read in place.
class Buffer : public Memory {
 public:
  explicit Buffer(int64_t nbytes);
  // A zero-copy view that keeps the memory alive: element [i, j, ...] at offset + (i * strides[0] +
  // j * strides[1] + ...) * itemsize, row-major where strides is empty.
  mlx::core::array array(int64_t offset, const std::vector<int64_t>& shape, mlx::core::Dtype dtype,
                         const std::vector<int64_t>& strides = {}) const;
  std::string describe() const override { return "buffer"; }
};

// Page-aligned, zero-filled memory mapped from the OS, outside MLX's allocator: scratch for a
// process that must never start a GPU device (the daemon; see docs/architecture.md).
class HostBuffer : public Memory {
 public:
  explicit HostBuffer(int64_t nbytes);
  std::string describe() const override { return "host buffer"; }
};

// A POSIX shared-memory object mapped into this process.
class Segment : public Memory {
 public:
  // Creates, sizes and maps the segment, then locks its pages in memory (mlock) or, where
  // that is not permitted, touches every page so that the memory is committed now; see
  // locked() and lock_error(). Runs without the GIL.
  // A taken name fails with EEXIST, naming who holds it.
  static Segment create(const std::string& name, int64_t nbytes, unsigned mode);
  // Maps a segment whose name came from elsewhere (a daemon's hello): never blocks on what holds the
  // name, and refuses anything but a segment of at least min_size bytes.
  static Segment open(const std::string& name, bool readonly, int64_t min_size = 0);
  // Removes the name; false if there was none. owner >= 0: only a segment that fstat says
  // belongs to that uid, otherwise a PermissionError and the name stays (also for a FIFO, a
  // directory or anything else that is not a segment, without blocking on it).
  static bool unlink(const std::string& name, int64_t owner = -1);

  const std::string& name() const { return name_; }
  // Whether create() locked the pages (false for opened segments), and why not.
  bool locked() const { return locked_; }
  const std::string& lock_error() const { return lock_error_; }
  // The owner and permission bits of the object, from fstat on the descriptor that was mapped: what a
  // client checks before it trusts the bytes (docs/security.md).
  unsigned owner_uid() const { return owner_uid_; }
  unsigned mode() const { return mode_; }
  bool closed() const { return region_ == nullptr; }
  // A zero-copy MLX view of the mapped bytes: element [i0, i1, ...] is at byte offset + sum(i_k *
  // strides[k]) * itemsize, so one array can span every slot of a layer with the slot stride as its
  // first stride. The view keeps the mapping alive. Where MLX cannot read the memory in place (a CUDA
  // build) it raises; callers copy instead (docs/architecture.md, "Zero-copy L2 reads").
  mlx::core::array array(int64_t offset, const std::vector<int64_t>& shape,
                         const std::vector<int64_t>& strides, mlx::core::Dtype dtype) const;
  // Gives the pages of [offset, offset + nbytes) back to the system (Linux: munlock, then
  // MADV_REMOVE frees the tmpfs pages; they read as zeros until written again). Returns whether
  // the pages were freed: false where the platform cannot (macOS keeps them, see
  // docs/architecture.md, "Memory governor"). Both calls take page-aligned ranges.
  bool release(int64_t offset, int64_t nbytes);
  // Takes a released range back: reserves its pages again (Linux: posix_fallocate through the descriptor
  // create() kept), so that no later touch of them can meet a full /dev/shm with SIGBUS, then locks them
  // again when create() locked the segment. An OSError (ENOSPC where /dev/shm is full) leaves the range
  // unusable: nothing may touch it until a later call succeeds. Only for segments this process created.
  void restore(int64_t offset, int64_t nbytes);
  // Maps a page-aligned range's pages for writing now, changing no byte (Linux 5.14+: MADV_POPULATE_WRITE;
  // elsewhere one write fault a page), so that a copy into them later takes no page fault: a mapping opened
  // here faults on every page it first writes. Writable segments only.
  void prefault(int64_t offset, int64_t nbytes);
  // Drops this object's mapping; the memory is unmapped once no view or running call uses it.
  void close() { region_.reset(); }
  std::string describe() const override { return "segment '" + name_ + "'"; }

 private:
  Segment(std::string name, std::shared_ptr<Region> region, bool readonly, unsigned owner_uid,
          unsigned mode)
      : Memory(std::move(region), readonly),
        name_(std::move(name)),
        owner_uid_(owner_uid),
        mode_(mode) {}

  std::string name_;
  bool locked_ = false;
  std::string lock_error_;
  unsigned owner_uid_;
  unsigned mode_;
};

}  // namespace moe_l2
