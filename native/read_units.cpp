// The units of the L3 reads and their direct I/O (read_units.h).
#include "read_units.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __APPLE__
#include <sys/param.h>
#endif

#include <nanobind/nanobind.h>

#include "records.h"

namespace nb = nanobind;

namespace moe_l2 {

namespace {

std::atomic<int64_t> g_direct_fallbacks{0};
std::atomic<int64_t> g_fail_direct{0};  // test hook: direct preads that fail with EINVAL

struct Block {
  std::byte* data = nullptr;
  size_t nbytes = 0;
};

constexpr size_t kKeepBytes = size_t(256) << 20;
constexpr size_t kKeepBlocks = 16;
std::mutex g_blocks_lock;
std::vector<Block> g_blocks;  // free blocks, oldest first

Block take_block(size_t nbytes) {
  // 1 MiB granularity, so that blocks fit the next similar request.
  size_t want = std::max<size_t>((nbytes + (size_t(1) << 20) - 1) & ~((size_t(1) << 20) - 1), size_t(1) << 20);
  {
    std::lock_guard<std::mutex> lock(g_blocks_lock);
    auto best = g_blocks.end();
    for (auto it = g_blocks.begin(); it != g_blocks.end(); ++it) {
      if (it->nbytes >= want && (best == g_blocks.end() || it->nbytes < best->nbytes)) {
        best = it;
      }
    }
    if (best != g_blocks.end()) {
      Block b = *best;
      g_blocks.erase(best);
      return b;
    }
  }
  void* p = nullptr;
  size_t align = huge_page_bytes() != 0 && want >= huge_page_bytes() ? huge_page_bytes() : kDirectAlign;
  if (posix_memalign(&p, align, want) != 0) {
    return {};
  }
  fresh_huge_pages(p, want);  // first touched by the reads themselves
  return {static_cast<std::byte*>(p), want};
}

void give_block(Block b) {
  if (b.data == nullptr) {
    return;
  }
  std::vector<Block> drop;
  {
    std::lock_guard<std::mutex> lock(g_blocks_lock);
    g_blocks.push_back(b);
    size_t total = 0;
    for (const Block& k : g_blocks) {
      total += k.nbytes;
    }
    while (!g_blocks.empty() && (total > kKeepBytes || g_blocks.size() > kKeepBlocks)) {
      total -= g_blocks.front().nbytes;
      drop.push_back(g_blocks.front());
      g_blocks.erase(g_blocks.begin());
    }
  }
  for (Block& k : drop) {
    free(k.data);
  }
}

// Whether reads through fd must be aligned (Linux O_DIRECT). macOS' F_NOCACHE takes any
// offset and length, so its fds read like buffered ones here.
bool fd_needs_alignment(int fd) {
#if defined(__linux__) && defined(O_DIRECT)
  int flags = fcntl(fd, F_GETFL);
  return flags != -1 && (flags & O_DIRECT) != 0;
#else
  (void)fd;
  return false;
#endif
}

bool take_injected_failure() {
  int64_t left = g_fail_direct.load();
  while (left > 0) {
    if (g_fail_direct.compare_exchange_weak(left, left - 1)) {
      return true;
    }
  }
  return false;
}

ssize_t pread_full(int fd, std::byte* buf, size_t n, size_t off, bool direct) {
  std::vector<iovec> iov{{buf, n}};
  return preadv_full(fd, iov, off, direct);
}

}  // namespace

Scratch::Scratch(size_t nbytes) {
  Block b = take_block(nbytes);
  data_ = b.data;
  nbytes_ = b.nbytes;
}

Scratch::~Scratch() { give_block({data_, nbytes_}); }

std::string fd_name(int fd) {
#if defined(__linux__)
  char buf[4096];
  ssize_t n = readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf - 1);
  if (n > 0) {
    return std::string(buf, size_t(n));
  }
#elif defined(__APPLE__)
  char buf[MAXPATHLEN];
  if (fcntl(fd, F_GETPATH, buf) != -1) {
    return buf;
  }
#endif
  return "fd " + std::to_string(fd);
}

FdState* FdStates::get(int fd) {
  for (auto& s : states_) {
    if (s->fd == fd) {
      return s.get();
    }
  }
  states_.push_back(std::make_unique<FdState>());
  states_.back()->fd = fd;
  states_.back()->direct.store(fd_needs_alignment(fd));
  return states_.back().get();
}

void fall_back_to_buffered(FdState& s) {
  bool expected = true;
  if (s.direct.compare_exchange_strong(expected, false)) {
#if defined(__linux__) && defined(O_DIRECT)
    int flags = fcntl(s.fd, F_GETFL);
    if (flags != -1) {
      fcntl(s.fd, F_SETFL, flags & ~O_DIRECT);
    }
#endif
    g_direct_fallbacks.fetch_add(1);
  }
}

ssize_t preadv_full(int fd, std::vector<iovec>& iov, size_t off, bool direct) {
  size_t done = 0;
  size_t first = 0;
  while (first < iov.size()) {
    if (direct && take_injected_failure()) {
      return -EINVAL;
    }
    int count = int(std::min<size_t>(iov.size() - first, IOV_MAX));
    ssize_t r = preadv(fd, iov.data() + first, count, static_cast<off_t>(off + done));
    if (r > 0) {
      done += size_t(r);
      for (size_t left = size_t(r); left > 0;) {
        size_t step = std::min(left, iov[first].iov_len);
        iov[first].iov_base = static_cast<std::byte*>(iov[first].iov_base) + step;
        iov[first].iov_len -= step;
        left -= step;
        if (iov[first].iov_len == 0) {
          ++first;
        }
      }
      if (direct && !is_aligned(size_t(r))) {
        break;  // a direct read stops short of a block only at the end of the file
      }
      continue;
    }
    if (r == 0) {
      break;
    }
    if (errno == EINTR) {
      continue;
    }
    return -errno;
  }
  return static_cast<ssize_t>(done);
}

std::optional<OsError> unit_result(const char* fn, const Unit& u, ssize_t got) {
  if (got >= 0 && size_t(got) >= u.need) {
    return std::nullopt;
  }
  size_t at = got >= 0 ? size_t(got) : 0;
  std::string where = "job " + std::to_string(u.job) + ": bytes [" + std::to_string(u.file_offset + at) +
                      ", " + std::to_string(u.file_offset + u.need) + ") of " + fd_name(u.fd->fd);
  if (got >= 0) {
    struct stat st;
    std::string size =
        fstat(u.fd->fd, &st) == 0 ? " (it has " + std::to_string(st.st_size) + " bytes)" : "";
    return OsError(0, prefixed(fn, "unexpected end of file in " + where + size + ": truncated model file?"));
  }
  int err = int(-got);
  return OsError(err, prefixed(fn, "reading " + where + " failed: " + std::strerror(err)));
}

std::optional<OsError> read_unit(const char* fn, const Unit& u) {
  for (;;) {
    bool direct = u.fd->direct.load(std::memory_order_relaxed);
    ssize_t got;
    if (!direct) {
      got = pread_full(u.fd->fd, u.dst, u.nbytes, u.file_offset, false);
    } else if (is_aligned(u.file_offset) && is_aligned(u.nbytes) &&
               is_aligned(reinterpret_cast<uintptr_t>(u.dst))) {
      got = pread_full(u.fd->fd, u.dst, u.nbytes, u.file_offset, true);
    } else {
      // Unaligned: read the covering blocks into a bounce buffer and copy the asked bytes.
      size_t start = align_down(u.file_offset);
      size_t end = align_up(u.file_offset + u.nbytes);
      Scratch bounce(end - start);
      if (!bounce) {
        return OsError(ENOMEM, prefixed(fn, "no memory for a " + std::to_string(end - start) +
                                                "-byte direct-read buffer"));
      }
      got = pread_full(u.fd->fd, bounce.data(), end - start, start, true);
      if (got >= 0) {
        size_t head = u.file_offset - start;
        size_t n = size_t(got) > head ? std::min(size_t(got) - head, u.nbytes) : 0;
        std::memcpy(u.dst, bounce.data() + head, n);
        got = static_cast<ssize_t>(n);
      }
    }
    if (got == -EINVAL && direct) {
      fall_back_to_buffered(*u.fd);
      continue;
    }
    return unit_result(fn, u, got);
  }
}

std::optional<OsError> run_parallel(size_t n, int threads,
                                    const std::function<std::optional<OsError>(size_t)>& work) {
  std::optional<OsError> failure;
  nb::gil_scoped_release unlocked;
  flush_read_wakes();
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex failure_lock;
  auto loop = [&] {
    for (size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
      if (auto err = work(i)) {
        std::lock_guard<std::mutex> lock(failure_lock);
        if (!failure) {
          failure = std::move(err);
        }
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  run_on_threads(std::min(n, size_t(threads)), loop);
  return failure;
}

void check_threads(const char* fn, int threads, int64_t unit_bytes) {
  if (threads < 1) {
    throw_value_error(fn, "threads must be >= 1, got " + std::to_string(threads));
  }
  // A multiple of the direct-read alignment, so that every unit of a direct read stays aligned.
  if (unit_bytes < int64_t(kDirectAlign) || unit_bytes % int64_t(kDirectAlign) != 0 ||
      unit_bytes > (int64_t(1) << 30)) {
    throw_value_error(fn, "unit_bytes must be a multiple of " + std::to_string(kDirectAlign) + " from " +
                              std::to_string(kDirectAlign) + " to 1 GiB, got " + std::to_string(unit_bytes));
  }
}

namespace {
thread_local std::vector<int> t_read_wakes;
}  // namespace

void wake_when_reading(std::vector<int> fds) { t_read_wakes = std::move(fds); }

void write_wake(int fd) {
  const char byte = 0;
  while (write(fd, &byte, 1) < 0 && errno == EINTR) {
  }  // a full pipe or socket holds wake-ups already (EAGAIN): nothing is lost
}

void flush_read_wakes() {
  for (int fd : t_read_wakes) {
    write_wake(fd);
  }
  t_read_wakes.clear();
}

int64_t direct_fallbacks() { return g_direct_fallbacks.load(); }

void fail_direct_reads(int64_t n) { g_fail_direct.store(std::max<int64_t>(n, 0)); }

}  // namespace moe_l2
