// POSIX shared-memory segments (Segment: create, open, unlink, release, restore, prefault; its MLX view, array, is
// memory.cpp's) and HostBuffer's anonymous pages: memory this process maps from the OS.
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory.h"

namespace moe_l2 {

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

std::atomic<bool> g_prefault_by_touch{false};  // test hook: the loop macOS runs, on Linux too

void prefault_by_touch(bool enable) { g_prefault_by_touch.store(enable); }

void Segment::prefault(int64_t offset, int64_t nbytes) {
  const char* fn = "Segment.prefault";
  if (region_ == nullptr || readonly()) {
    throw_value_error(fn, describe() + " is closed or read-only");
  }
  auto [addr, len] = page_range(fn, *this, offset, nbytes, region_->data);
#if defined(__linux__)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14's; an older kernel answers EINVAL, and the loop below runs
#endif
  if (!g_prefault_by_touch.load() && len != 0) {
    if (madvise(addr, len, MADV_POPULATE_WRITE) == 0) {
      return;
    }
    if (errno != EINVAL) {
      int err = errno;
      throw OsError(err, prefixed(fn, "cannot map pages of " + describe() + ": " + errno_text(err)));
    }
  }
#endif
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t off = 0; off < len; off += page) {
    // An atomic or of zero: a write fault that changes no byte, whoever else writes the page meanwhile.
    __atomic_fetch_or(reinterpret_cast<unsigned char*>(addr + off), 0, __ATOMIC_RELAXED);
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
