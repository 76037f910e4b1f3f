#include "memory.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mlx/allocator.h>
#include <mlx/backend/cuda/cuda.h>
#include <mlx/backend/metal/metal.h>

namespace mx = mlx::core;

namespace moe_l2 {

std::string prefixed(const char* fn, const std::string& msg) {
  return std::string("[") + fn + "] " + msg;
}

void throw_value_error(const char* fn, const std::string& msg) {
  throw std::invalid_argument(prefixed(fn, msg));
}

size_t huge_page_bytes() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  return size_t(2) << 20;
#else
  return 0;
#endif
}

void fresh_huge_pages(void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = huge_page_bytes();
  uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + huge - 1) & ~(huge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(huge - 1);
  if (hi > lo) {
    // Memory the allocator hands out again may already have small pages, which the hint alone leaves
    // as they are: drop them first (the caller owns these bytes and has no use for what they held).
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: refused, the pages stay small
  }
#else
  (void)data;
  (void)nbytes;
#endif
}

size_t checked_add(const char* fn, size_t a, size_t b) {
  size_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    throw_value_error(fn, "size overflow (" + std::to_string(a) + " + " + std::to_string(b) + ")");
  }
  return r;
}

size_t checked_mul(const char* fn, size_t a, size_t b) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw_value_error(fn, "size overflow (" + std::to_string(a) + " * " + std::to_string(b) + ")");
  }
  return r;
}

size_t to_size(const char* fn, const char* what, int64_t v) {
  if (v < 0) {
    throw_value_error(fn, std::string(what) + " must be >= 0, got " + std::to_string(v));
  }
  return static_cast<size_t>(v);
}

// ---------------------------------------------------------------------------------------
// Memory

std::shared_ptr<Region> Memory::region(const char* fn, bool writable) const {
  if (!region_) {
    throw_value_error(fn, describe() + " is closed");
  }
  if (writable && readonly_) {
    throw_value_error(fn, describe() + " is read-only");
  }
  return region_;
}

uintptr_t Memory::address(const char* fn) const {
  return reinterpret_cast<uintptr_t>(region(fn)->data);
}

void Memory::check_range(const char* fn, size_t offset, size_t nbytes) const {
  if (offset > nbytes_ || nbytes > nbytes_ - offset) {
    throw_value_error(fn, "bytes [" + std::to_string(offset) + ", " +
                              std::to_string(offset + nbytes) + ") are outside " + describe() +
                              " of " + std::to_string(nbytes_) + " bytes");
  }
}

uint32_t* Memory::word(const char* fn, size_t off, bool writable) const {
  std::byte* base = region(fn, writable)->data;
  if (off % alignof(uint32_t) != 0) {
    throw_value_error(fn, "offset " + std::to_string(off) + " is not 4-byte aligned");
  }
  check_range(fn, off, sizeof(uint32_t));
  return reinterpret_cast<uint32_t*>(base + off);
}

uint32_t Memory::load_u32(size_t off) const {
  return __atomic_load_n(word("Memory.load_u32", off, false), __ATOMIC_ACQUIRE);
}

int32_t Memory::load_i32(size_t off) const {
  return static_cast<int32_t>(
      __atomic_load_n(word("Memory.load_i32", off, false), __ATOMIC_ACQUIRE));
}

void Memory::store_u32(size_t off, uint32_t v) {
  __atomic_store_n(word("Memory.store_u32", off, true), v, __ATOMIC_RELEASE);
}

void Memory::store_i32(size_t off, int32_t v) {
  __atomic_store_n(word("Memory.store_i32", off, true), static_cast<uint32_t>(v),
                   __ATOMIC_RELEASE);
}

// ---------------------------------------------------------------------------------------
// Buffer
//
// mlx::core::array(void*, shape, dtype, deleter) only wraps foreign memory where the backend
// allocator can (Metal); the CPU and CUDA allocators make it copy, so writes to the original
// memory would go unseen. Instead MLX allocates, and every array is a view sharing that
// allocation (copy_shared_buffer), which keeps it alive as long as any view exists.

namespace {

struct MlxRegion : Region {
  explicit MlxRegion(mx::array anchor) : anchor(std::move(anchor)) {}
  mx::array anchor;  // uint8 view whose first byte is `data`
};

// A byte offset where an array of itemsize-byte items may start.
size_t item_offset(const char* fn, int64_t offset_in, size_t itemsize) {
  size_t offset = to_size(fn, "offset", offset_in);
  if (offset % itemsize != 0) {
    throw_value_error(fn, "offset " + std::to_string(offset) + " is not a multiple of the " +
                              std::to_string(itemsize) + "-byte item size");
  }
  return offset;
}

// An array that owns nothing yet: copy_shared_buffer then points it into another's memory.
mx::array unbacked(mx::Shape shape, mx::Dtype dtype) {
  return mx::array(mx::allocator::Data(mx::allocator::Buffer(nullptr), [](mx::allocator::Buffer) {}),
                   std::move(shape), dtype);
}

// A view's shape and strides (in items; row-major where `strides_in` is empty), checked: the items it
// spans from its first (0 when empty) and the flags MLX gives an array laid out so.
struct ViewShape {
  mx::Shape shape;
  mx::Strides strides;
  size_t span = 0;
  mx::array::Flags flags{};
};

ViewShape view_shape(const char* fn, const std::vector<int64_t>& shape_in, const std::vector<int64_t>& strides_in) {
  if (!strides_in.empty() && strides_in.size() != shape_in.size()) {
    throw_value_error(fn, "shape and strides must be of one length");
  }
  size_t n = shape_in.size();
  std::vector<size_t> strides(n);
  size_t count = 1;  // items, and the stride a row-major layout would have at each dimension
  size_t last = 0;   // the largest item index the view reaches
  int64_t max_dim = 0;
  bool row_major = true;
  for (size_t k = n; k-- > 0;) {
    int64_t d = shape_in[k];
    if (d < 0 || d > std::numeric_limits<mx::ShapeElem>::max()) {
      throw_value_error(fn, "shape dimension " + std::to_string(d) + " is out of range");
    }
    strides[k] = strides_in.empty() ? count : to_size(fn, "stride", strides_in[k]);
    row_major = row_major && (d == 1 || strides[k] == count);
    if (d > 0) {
      last = checked_add(fn, last, checked_mul(fn, static_cast<size_t>(d - 1), strides[k]));
    }
    count = checked_mul(fn, count, static_cast<size_t>(d));
    max_dim = std::max(max_dim, d);
  }
  ViewShape view;
  for (size_t k = 0; k < n; ++k) {
    view.shape.push_back(static_cast<mx::ShapeElem>(shape_in[k]));
    view.strides.push_back(static_cast<int64_t>(strides[k]));
  }
  view.span = count == 0 ? 0 : checked_add(fn, last, 1);
  view.flags = {row_major, row_major, row_major && (count <= 1 || count == static_cast<size_t>(max_dim))};
  return view;
}

// Zero-filled, page-aligned bytes from MLX's allocator.
std::shared_ptr<Region> allocate(int64_t nbytes_in) {
  const char* fn = "Buffer";
  size_t nbytes = to_size(fn, "nbytes", nbytes_in);
  if (nbytes == 0) {
    throw_value_error(fn, "nbytes must be > 0");
  }
  // Over-allocate so the usable range can start on a page boundary (O_DIRECT reads, page-granular
  // Metal wrapping; the CPU allocator's own pointers are only 8-byte aligned), and where huge pages
  // serve it (fresh_huge_pages), a buffer of one or more on a huge-page boundary, so that all of it
  // gets them: the padding before it is not touched here.
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  bool huge = huge_page_bytes() != 0 && nbytes >= huge_page_bytes() && !mx::cu::is_available();
  size_t align = huge ? huge_page_bytes() : page;  // CUDA's allocator hands out managed memory: left alone
  mx::allocator::Data data = mx::allocator::malloc(checked_add(fn, nbytes, align - 1));
  auto* raw = static_cast<std::byte*>(data.buffer().raw_ptr());
  if (raw == nullptr) {
    throw std::bad_alloc();
  }
  size_t pad = (align - reinterpret_cast<uintptr_t>(raw) % align) % align;
  if (huge) {
    fresh_huge_pages(raw + pad, nbytes);
  }
  std::memset(raw + pad, 0, nbytes);

  mx::array base(std::move(data), mx::Shape{1}, mx::uint8);
  mx::array anchor = unbacked(mx::Shape{1}, mx::uint8);
  anchor.copy_shared_buffer(base, mx::Strides{1}, {true, true, true}, 1, static_cast<int64_t>(pad));
  auto region = std::make_shared<MlxRegion>(std::move(anchor));
  region->data = raw + pad;
  region->nbytes = nbytes;
  return region;
}

}  // namespace

Buffer::Buffer(int64_t nbytes) : Memory(allocate(nbytes), false) {}

mx::array Buffer::array(int64_t offset_in, const std::vector<int64_t>& shape_in, mx::Dtype dtype,
                        const std::vector<int64_t>& strides_in) const {
  const char* fn = "Buffer.array";
  size_t itemsize = mx::size_of(dtype);
  size_t offset = item_offset(fn, offset_in, itemsize);
  ViewShape view = view_shape(fn, shape_in, strides_in);
  check_range(fn, offset, checked_mul(fn, view.span, itemsize));

  auto region = std::static_pointer_cast<MlxRegion>(this->region(fn));
  mx::array array = unbacked(std::move(view.shape), dtype);
  array.copy_shared_buffer(region->anchor, view.strides, view.flags, view.span,
                           static_cast<int64_t>(offset / itemsize));
  return array;
}

// ---------------------------------------------------------------------------------------
// Segment

namespace {

struct Mapping : Region {
  // fd: the segment's descriptor, kept by its creator to reserve released pages again (Segment::restore);
  // -1 for a segment opened by name.
  Mapping(void* addr, size_t len, int fd = -1) : fd(fd) {
    data = static_cast<std::byte*>(addr);
    nbytes = len;
  }
  ~Mapping() override {
    munmap(data, nbytes);
    if (fd >= 0) {
      ::close(fd);
    }
  }
  int fd;
};

// macOS allows 31 characters (PSHMNAMLEN); POSIX wants one leading '/' and no other.
void check_name(const char* fn, const std::string& name) {
  if (name.size() < 2 || name.size() > 31 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.find('\0') != std::string::npos) {
    throw_value_error(fn, "invalid segment name '" + name +
                              "': it must be '/' followed by 1 to 30 characters other than '/' "
                              "(31 in all, the macOS limit)");
  }
}

std::string errno_text(int err) { return std::strerror(err); }

// Flags for opening a name someone else may have made. Linux's shm_open is open() of /dev/shm/NAME
// (glibc adds O_NOFOLLOW | O_CLOEXEC and passes O_NONBLOCK through), where any local user can plant
// a FIFO, which would block the open until a writer came, or a link: O_NONBLOCK and O_NOFOLLOW keep
// the open from waiting or following, and fstat's S_ISREG then refuses what is not a plain segment.
// macOS' shared-memory objects are not files (nothing but a segment can hold a name), and its
// shm_open knows only the access and creation flags, so there none are added.
#ifdef __APPLE__
constexpr int kUntrustedOpen = 0;
#else
constexpr int kUntrustedOpen = O_NONBLOCK | O_NOFOLLOW;
#endif

// Whether fstat describes a shared-memory segment: a regular file of /dev/shm on Linux; on macOS
// fstat of a segment gives permission bits only (no file type), so there no type or a regular file
// passes.
bool is_segment(const struct stat& st) {
#ifdef __APPLE__
  return (st.st_mode & S_IFMT) == 0 || S_ISREG(st.st_mode);
#else
  return S_ISREG(st.st_mode);
#endif
}

std::string file_type(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a regular file";
}

// Who holds a name that create() found taken, for its error: fstat where this user may open the
// object, else (Linux) lstat of its file in /dev/shm. A macOS segment has no path, so there the owner
// of one this user may not open cannot be known.
std::string taken_by(const std::string& name) {
  struct stat st;
  int fd = shm_open(name.c_str(), O_RDONLY | kUntrustedOpen, 0);
  bool known = fd >= 0 && fstat(fd, &st) == 0;
  if (fd >= 0) {
    ::close(fd);
  }
#ifdef __linux__
  known = known || lstat(("/dev/shm" + name).c_str(), &st) == 0;
#endif
  if (!known) {
#ifdef __APPLE__
    return " (its owner cannot be read: this user may not open it, and macOS shows a segment "
           "nowhere else; if no process should hold it, unlink it first)";
#else
    return " (its owner cannot be read: it went away meanwhile; try again)";
#endif
  }
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return std::string(" (") + (is_segment(st) ? "a segment" : file_type(st.st_mode)) + " of uid " +
         std::to_string(st.st_uid) + ", mode " + mode +
         "; if no process of that user should hold it, unlink it first)";
}

// What the user can do about a failed shm_open.
std::string open_hint(int err, bool creating) {
  switch (err) {
    case ENOENT:
      return creating ? "" : " (the daemon is not running, or it restarted with new segments)";
    case EACCES:
      return " (it belongs to another user: check the daemon's user, group and segment mode)";
    case EMFILE:
    case ENFILE:
      return " (too many open files: raise the limit with ulimit -n)";
    default:
      return "";
  }
}

std::string space_hint(int err) {
  if (err == ENOSPC || err == ENOMEM) {
    return " (shared memory is full: /dev/shm on Linux is a tmpfs, often half of RAM and 64 MiB "
           "in containers; remove stale segments, enlarge it, e.g. docker run --shm-size, or "
           "lower the budget)";
  }
  return "";
}

// Allocates the pages of [offset, offset + nbytes) of a segment (Linux; elsewhere 0, nothing to do): 0 or the
// errno, ENOSPC where /dev/shm is full.
int reserve_pages(int fd, size_t offset, size_t nbytes) {
#ifdef __linux__
  int err;
  do {
    err = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(nbytes));
  } while (err == EINTR);
  return err;
#else
  (void)fd;
  (void)offset;
  (void)nbytes;
  return 0;
#endif
}

}  // namespace

Segment Segment::create(const std::string& name, int64_t nbytes_in, unsigned mode) {
  const char* fn = "Segment.create";
  check_name(fn, name);
  size_t nbytes = to_size(fn, "nbytes", nbytes_in);
  if (nbytes == 0) {
    throw_value_error(fn, "nbytes must be > 0");
  }
  if (mode > 0777) {
    throw_value_error(fn, "mode must be permission bits (<= 0o777)");
  }

  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, static_cast<mode_t>(mode));
  if (fd < 0) {
    int err = errno;
    throw OsError(err, prefixed(fn, "cannot create shared-memory segment '" + name + "': " +
                                        errno_text(err) +
                                        (err == EEXIST ? taken_by(name) : open_hint(err, true))));
  }
  // Past this point a failure removes the half-made segment.
  auto fail = [&](const std::string& step, int err) {
    ::close(fd);
    shm_unlink(name.c_str());
    throw OsError(err, prefixed(fn, "cannot " + step + " shared-memory segment '" + name +
                                        "': " + errno_text(err) + space_hint(err)));
  };

  // The caller's mode (e.g. group access) is meant as given. Linux's shm_open applies the
  // umask, so the mode is set again; macOS' shm_open ignores the umask and its shared-memory
  // objects have no fchmod, so there the mode is already exact.
  struct stat st;
  if (fstat(fd, &st) != 0) {
    fail("stat", errno);
  }
  if ((st.st_mode & 0777) != mode && fchmod(fd, static_cast<mode_t>(mode)) != 0) {
    fail("set the mode of", errno);
  }
  if (ftruncate(fd, static_cast<off_t>(nbytes)) != 0) {
    fail("size (" + std::to_string(nbytes) + " bytes)", errno);
  }
  // Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of killing the
  // writer with SIGBUS when it first touches a page that cannot be backed.
  int err = reserve_pages(fd, 0, nbytes);
  if (err != 0 && err != EOPNOTSUPP && err != ENOSYS && err != EINVAL) {
    fail("reserve " + std::to_string(nbytes) + " bytes for", err);
  }
  void* addr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    fail("map", errno);
  }
  // The descriptor stays open with the mapping: restore() reserves released pages through it, and a flood
  // that fills the descriptor table cannot keep it from doing so.
  Segment segment(name, std::make_shared<Mapping>(addr, nbytes, fd), false,
                  static_cast<unsigned>(st.st_uid), mode);
  // Neither system wires shared memory by itself: tmpfs pages can be swapped, macOS pages
  // compressed or swapped. Lock them where the limits allow (root, CAP_IPC_LOCK, or a
  // large enough RLIMIT_MEMLOCK); otherwise commit every page now by touching it, so that the
  // memory is at least taken, and accounted, at start (docs/architecture.md, "Shared memory").
  if (mlock(addr, nbytes) == 0) {
    segment.locked_ = true;
  } else {
    int lock_err = errno;
    segment.lock_error_ = prefixed(fn, "cannot lock the " + std::to_string(nbytes) +
                                           " bytes of segment '" + name + "' in memory: " +
                                           errno_text(lock_err));
    volatile std::byte* bytes = static_cast<std::byte*>(addr);
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < nbytes; off += page) {
      bytes[off] = std::byte{0};  // fresh pages are zero: this commits them without changing them
    }
  }
  return segment;
}

namespace {

std::pair<std::byte*, size_t> page_range(const char* fn, const Segment& segment, int64_t offset,
                                         int64_t nbytes_in, std::byte* base) {
  size_t off = to_size(fn, "offset", offset);
  size_t len = to_size(fn, "nbytes", nbytes_in);
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (off % page != 0 || len % page != 0 || off > segment.nbytes() || len > segment.nbytes() - off) {
    throw_value_error(fn, "range [" + std::to_string(off) + ", +" + std::to_string(len) +
                              ") is not a page-aligned part of " + segment.describe());
  }
  return {base + off, len};
}

}  // namespace

bool Segment::release(int64_t offset, int64_t nbytes) {
  const char* fn = "Segment.release";
  if (region_ == nullptr || readonly()) {
    throw_value_error(fn, describe() + " is closed or read-only");
  }
  auto [addr, len] = page_range(fn, *this, offset, nbytes, region_->data);
  if (len == 0) {
    return true;
  }
#ifdef __linux__
  if (locked_) {
    munlock(addr, len);  // MADV_REMOVE refuses locked pages
  }
  if (madvise(addr, len, MADV_REMOVE) != 0) {
    int err = errno;
    if (locked_) {
      mlock(addr, len);
    }
    throw OsError(err, prefixed(fn, "cannot release pages of " + describe() + ": " +
                                        errno_text(err)));
  }
  return true;
#else
  (void)addr;  // macOS has no call that frees a shared-memory object's pages under a mapping
  return false;
#endif
}

void Segment::restore(int64_t offset, int64_t nbytes) {
  const char* fn = "Segment.restore";
  if (region_ == nullptr || readonly()) {
    throw_value_error(fn, describe() + " is closed or read-only");
  }
  auto [addr, len] = page_range(fn, *this, offset, nbytes, region_->data);
  if (len == 0) {
    return;
  }
  int fd = static_cast<const Mapping&>(*region_).fd;
  if (fd < 0) {
    throw_value_error(fn, "only the process that created " + describe() + " can take its pages back");
  }
  // Released pages are holes in /dev/shm: the first touch of one would allocate it, and where /dev/shm has
  // filled meanwhile that touch is a SIGBUS. Allocated now, a full /dev/shm is an error here instead.
  int err = reserve_pages(fd, static_cast<size_t>(addr - region_->data), len);
  if (err != 0) {
    throw OsError(err, prefixed(fn, "cannot reserve " + std::to_string(len) + " bytes of " + describe() +
                                        " again: " + errno_text(err) + space_hint(err)));
  }
  if (locked_) {
    mlock(addr, len);  // best effort, as at create(): the limit may have shrunk since
  }
}

Segment Segment::open(const std::string& name, bool readonly, int64_t min_size) {
  const char* fn = "Segment.open";
  check_name(fn, name);
  size_t least = to_size(fn, "min_size", min_size);
  // The name comes from whoever answered hello: it is opened as untrusted (kUntrustedOpen, is_segment).
  int fd = shm_open(name.c_str(), (readonly ? O_RDONLY : O_RDWR) | kUntrustedOpen, 0);
  if (fd < 0) {
    int err = errno;
    throw OsError(err, prefixed(fn, "cannot open shared-memory segment '" + name + "': " +
                                        errno_text(err) + open_hint(err, false)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw OsError(err, prefixed(fn, "cannot stat shared-memory segment '" + name + "': " +
                                        errno_text(err)));
  }
  if (!is_segment(st)) {
    ::close(fd);
    throw_value_error(fn, "'" + name + "' is " + file_type(st.st_mode) +
                              ", not a shared-memory segment; refused");
  }
  if (st.st_size <= 0) {
    ::close(fd);
    throw_value_error(fn, "shared-memory segment '" + name +
                              "' is empty (its creator has not sized it yet)");
  }
  size_t nbytes = static_cast<size_t>(st.st_size);
  if (nbytes < least) {
    ::close(fd);
    throw_value_error(fn, "shared-memory segment '" + name + "' has " + std::to_string(nbytes) +
                              " bytes, fewer than the " + std::to_string(least) +
                              " expected; refused");
  }
  int prot = readonly ? PROT_READ : PROT_READ | PROT_WRITE;
  void* addr = mmap(nullptr, nbytes, prot, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (addr == MAP_FAILED) {
    throw OsError(err, prefixed(fn, "cannot map shared-memory segment '" + name + "' (" +
                                        std::to_string(nbytes) + " bytes): " + errno_text(err)));
  }
  return Segment(name, std::make_shared<Mapping>(addr, nbytes), readonly,
                 static_cast<unsigned>(st.st_uid), static_cast<unsigned>(st.st_mode & 07777));
}

mx::array Segment::array(int64_t offset_in, const std::vector<int64_t>& shape_in,
                         const std::vector<int64_t>& strides_in, mx::Dtype dtype) const {
  const char* fn = "Segment.array";
  size_t itemsize = mx::size_of(dtype);
  size_t offset = item_offset(fn, offset_in, itemsize);
  if (shape_in.empty() || shape_in.size() != strides_in.size()) {
    throw_value_error(fn, "shape and strides must be non-empty and of one length");
  }
  for (int64_t d : shape_in) {
    if (d < 1) {
      throw_value_error(fn, "shape dimension " + std::to_string(d) + " is out of range");
    }
  }
  ViewShape view = view_shape(fn, shape_in, strides_in);
  check_range(fn, offset, checked_mul(fn, view.span, itemsize));

  auto mapping = region(fn);
  mx::allocator::Buffer buffer = mx::allocator::make_buffer(mapping->data, mapping->nbytes);
  int64_t base = 0;  // bytes from the buffer's start to the mapping's
  mx::allocator::Deleter release;
  if (buffer.ptr() != nullptr) {
    // Metal: a no-copy MTLBuffer over the page-aligned mapping.
    release = [mapping](mx::allocator::Buffer b) { mx::allocator::release(b); };
  } else if (!mx::metal::is_available() && !mx::cu::is_available()) {
    // CPU kernels read data() = buffer.raw_ptr() + offset and nothing else of the buffer: a small
    // allocation of MLX's own anchors the view, and the offset reaches the mapping from it. The anchor
    // is shared with no other array, so MLX never donates (writes) it or reads past it.
    buffer = mx::allocator::allocator().malloc(itemsize);
    base = reinterpret_cast<intptr_t>(mapping->data) -
           reinterpret_cast<intptr_t>(buffer.raw_ptr());
    release = [mapping](mx::allocator::Buffer b) { mx::allocator::allocator().free(b); };
  } else {
    throw std::runtime_error(prefixed(
        fn, "this MLX build cannot compute on shared memory in place (no Metal, not the CPU "
            "backend); copy the records instead"));
  }
  mx::array array = unbacked(std::move(view.shape), dtype);
  array.set_data(mx::allocator::Data(buffer, std::move(release)), view.span, std::move(view.strides), view.flags,
                 base + static_cast<int64_t>(offset));
  return array;
}

bool Segment::unlink(const std::string& name, int64_t owner) {
  const char* fn = "Segment.unlink";
  check_name(fn, name);
  if (owner >= 0) {
    // Reclaim runs at every start: whatever holds a listed name must not make it wait (kUntrustedOpen).
    int fd = shm_open(name.c_str(), O_RDONLY | kUntrustedOpen, 0);
    if (fd < 0) {
      int err = errno;
      if (err == ENOENT) {
        return false;
      }
      throw OsError(err, prefixed(fn, "cannot open shared-memory segment '" + name +
                                          "' to check its owner: " + errno_text(err) +
                                          open_hint(err, false)));
    }
    struct stat st;
    int err = fstat(fd, &st) == 0 ? 0 : errno;
    ::close(fd);
    if (err != 0) {
      throw OsError(err, prefixed(fn, "cannot stat shared-memory segment '" + name + "': " +
                                          errno_text(err)));
    }
    if (!is_segment(st)) {
      throw OsError(EPERM, prefixed(fn, "'" + name + "' is " + file_type(st.st_mode) +
                                            ", not a shared-memory segment: left in place"));
    }
    if (static_cast<int64_t>(st.st_uid) != owner) {
      throw OsError(EPERM, prefixed(fn, "shared-memory segment '" + name + "' belongs to uid " +
                                            std::to_string(st.st_uid) + ", not to uid " +
                                            std::to_string(owner) + ": left in place"));
    }
  }
  if (shm_unlink(name.c_str()) == 0) {
    return true;
  }
  int err = errno;
  if (err == ENOENT) {
    return false;
  }
  throw OsError(err, prefixed(fn, "cannot unlink shared-memory segment '" + name + "': " +
                                      errno_text(err) + open_hint(err, false)));
}

// ---------------------------------------------------------------------------------------
// HostBuffer

namespace {

// Anonymous pages: page-aligned and zero-filled by the kernel, and never seen by MLX, so that
// using them starts no Metal or CUDA device.
std::shared_ptr<Region> map_host(int64_t nbytes_in) {
  const char* fn = "HostBuffer";
  size_t nbytes = to_size(fn, "nbytes", nbytes_in);
  if (nbytes == 0) {
    throw_value_error(fn, "nbytes must be > 0");
  }
  void* addr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
  if (addr == MAP_FAILED) {
    int err = errno;
    throw OsError(err, prefixed(fn, "cannot map " + std::to_string(nbytes) +
                                        " bytes of memory: " + errno_text(err)));
  }
  fresh_huge_pages(addr, nbytes);
  return std::make_shared<Mapping>(addr, nbytes);
}

}  // namespace

HostBuffer::HostBuffer(int64_t nbytes) : Memory(map_host(nbytes), false) {}

}  // namespace moe_l2
