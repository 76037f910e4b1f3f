// L3 reads: parallel pread of record pieces (pread_records), one read per record scattered into
// its pieces (pread_scatter: one preadv a unit, straight into the pieces where alignment allows),
// direct I/O (O_DIRECT on Linux, F_NOCACHE on macOS) with aligned bounce buffers and a buffered
// fallback, and a page-cache probe (mincore) for benchmarks.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __APPLE__
#include <sys/param.h>
#endif

#include <nanobind/nanobind.h>

#include "crc32.h"
#include "records.h"

namespace nb = nanobind;

namespace moe_l2 {

namespace {

// Jobs are cut into units of at most unit_bytes (callers choose it: the queue depth a record's read
// gets is min(threads, record / unit_bytes)); no single pread nears the OS limits at the default.

// Direct reads use this alignment for file offsets, lengths and memory: the largest logical
// block size in common use (512 and 4096 both divide it). A filesystem that wants more makes
// the read fail with EINVAL, and the fd falls back to buffered reads.
constexpr size_t kDirectAlign = 4096;

std::atomic<int64_t> g_direct_fallbacks{0};
std::atomic<int64_t> g_fail_direct{0};  // test hook: direct preads that fail with EINVAL
std::atomic<bool> g_scatter_straight{true};  // bench hook: false reads every piece through the scratch

size_t align_down(size_t v) { return v & ~(kDirectAlign - 1); }
size_t align_up(size_t v) { return (v + kDirectAlign - 1) & ~(kDirectAlign - 1); }
bool is_aligned(size_t v) { return (v & (kDirectAlign - 1)) == 0; }

// ---------------------------------------------------------------------------------------
// Aligned scratch memory (bounce buffers), cached between calls so that a miss does not pay
// for fresh pages every time.

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

class Scratch {
 public:
  explicit Scratch(size_t nbytes) : block_(take_block(nbytes)) {}
  ~Scratch() { give_block(block_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::byte* data() const { return block_.data; }
  explicit operator bool() const { return block_.data != nullptr; }

 private:
  Block block_;
};

// ---------------------------------------------------------------------------------------

// The file behind fd for error messages; best effort.
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

struct FdState {
  int fd;
  std::atomic<bool> direct;
};

// One FdState per distinct fd of a call, so that a fallback seen by one thread holds for all.
class FdStates {
 public:
  FdState* get(int fd) {
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

 private:
  std::vector<std::unique_ptr<FdState>> states_;
};

// The filesystem refused a direct read: read through the page cache from now on.
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

bool take_injected_failure() {
  int64_t left = g_fail_direct.load();
  while (left > 0) {
    if (g_fail_direct.compare_exchange_weak(left, left - 1)) {
      return true;
    }
  }
  return false;
}

// Reads up to the iovecs' total at off into them, in order; stops early only at the end of the
// file. Short reads continue where they stopped (iov is advanced past what was read), EINTR
// retries. Returns the bytes read, or -errno.
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

ssize_t pread_full(int fd, std::byte* buf, size_t n, size_t off, bool direct) {
  std::vector<iovec> iov{{buf, n}};
  return preadv_full(fd, iov, off, direct);
}

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

// Runs work(i) for i in [0, n) on up to `threads` threads with the GIL released; returns the
// first failure once every thread has stopped (no new item starts after a failure).
std::optional<OsError> run_parallel(size_t n, int threads,
                                    const std::function<std::optional<OsError>(size_t)>& work) {
  std::optional<OsError> failure;
  nb::gil_scoped_release unlocked;
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

}  // namespace

void pread_records(const std::vector<ReadJob>& jobs, int threads, int64_t unit_bytes) {
  const char* fn = "pread_records";
  check_threads(fn, threads, unit_bytes);
  const size_t unit = size_t(unit_bytes);
  std::vector<std::shared_ptr<Region>> regions;  // kept mapped while the GIL is released
  std::vector<Unit> units;
  FdStates fds;
  for (size_t j = 0; j < jobs.size(); ++j) {
    auto [fd, file_offset_in, nbytes_in, dst, dst_offset_in] = jobs[j];
    std::string what = "jobs[" + std::to_string(j) + "]";
    if (fd < 0) {
      throw_value_error(fn, what + ": invalid file descriptor " + std::to_string(fd));
    }
    if (dst == nullptr) {
      throw_value_error(fn, what + " has no destination");
    }
    size_t file_offset = to_size(fn, (what + " file_offset").c_str(), file_offset_in);
    size_t nbytes = to_size(fn, (what + " nbytes").c_str(), nbytes_in);
    size_t dst_offset = to_size(fn, (what + " dst_offset").c_str(), dst_offset_in);
    checked_add(fn, file_offset, nbytes);
    dst->check_range(fn, dst_offset, nbytes);
    regions.push_back(dst->region(fn, true));
    std::byte* out = regions.back()->data + dst_offset;
    FdState* state = fds.get(fd);
    for (size_t done = 0; done < nbytes; done += unit) {
      size_t n = std::min(unit, nbytes - done);
      units.push_back({j, state, file_offset + done, n, n, out + done});
    }
  }
  if (auto failure = run_parallel(units.size(), threads, [&](size_t i) { return read_unit(fn, units[i]); })) {
    throw *failure;
  }
}

namespace {

struct ScatterPlanPiece {
  size_t src_off;
  size_t nbytes;
  std::byte* dst;
  const Region* region;  // the memory dst lies in
};

// Bytes [lo, hi) of a job (offsets in its extent) read straight into memory, byte lo landing at dst.
struct StraightRange {
  size_t lo;
  size_t hi;
  std::byte* dst;
};

// What of a job is read straight into its destinations: each run of pieces (in file order) that lie in
// one memory as they lie in the file, the bytes between them included (a record's padding, into the
// memory between its pieces: an L0 row laid out as the record is); on a direct fd only the part of the run
// between block boundaries, where the memory is block-aligned too (so the read stays a direct one). The
// rest (a run's unaligned ends, pieces that share bytes with another, so that every piece copied out of
// the scratch finds its bytes there) is read into the scratch and copied out. In file order.
std::vector<StraightRange> straight_ranges(const std::vector<ScatterPlanPiece>& pieces, size_t file_offset,
                                           bool direct) {
  std::vector<StraightRange> ranges;
  if (!g_scatter_straight.load()) {
    return ranges;
  }
  std::vector<size_t> order;
  for (size_t p = 0; p < pieces.size(); ++p) {
    if (pieces[p].nbytes > 0) {
      order.push_back(p);
    }
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pieces[a].src_off < pieces[b].src_off; });
  std::vector<bool> shares(order.size());
  size_t reach = 0;  // the furthest end of the pieces before this one, in file order
  for (size_t k = 0; k < order.size(); ++k) {
    const ScatterPlanPiece& piece = pieces[order[k]];
    size_t end = piece.src_off + piece.nbytes;
    shares[k] = (k > 0 && reach > piece.src_off) || (k + 1 < order.size() && pieces[order[k + 1]].src_off < end);
    reach = std::max(reach, end);
  }
  auto base = [](const ScatterPlanPiece& p) { return reinterpret_cast<uintptr_t>(p.dst) - p.src_off; };
  for (size_t k = 0; k < order.size();) {
    const ScatterPlanPiece& first = pieces[order[k]];
    if (shares[k]) {
      ++k;
      continue;
    }
    size_t lo = first.src_off, hi = lo + first.nbytes;
    for (++k; k < order.size() && !shares[k]; ++k) {
      const ScatterPlanPiece& next = pieces[order[k]];
      if (next.region != first.region || base(next) != base(first)) {
        break;
      }
      hi = next.src_off + next.nbytes;
    }
    size_t from = lo, to = hi;
    if (direct) {
      size_t a = align_up(file_offset + lo), b = align_down(file_offset + hi);
      if (a >= b || !is_aligned(base(first) + (a - file_offset))) {
        continue;
      }
      from = a - file_offset;
      to = b - file_offset;
    }
    ranges.push_back({from, to, first.dst + (from - lo)});
  }
  return ranges;
}

// One job of pread_scatter, checked and planned.
struct ScatterPlanJob {
  FdState* fd;
  size_t file_offset;  // where the job's extent starts in the file
  size_t end;          // and where it ends
  size_t read_start;   // what its units read: the extent, in whole blocks on a direct fd
  size_t read_stop;
  std::vector<ScatterPlanPiece> pieces;
  std::vector<StraightRange> straight;  // straight_ranges'
  size_t scratch_offset = 0;  // where [read_start, read_stop) lands in the scratch
  size_t first_unit = 0;      // the job's units are [first_unit, first_unit + n_units) of the call's
  size_t n_units = 0;
  size_t first_part = 0;  // with checksums, its ChecksumParts from here: n_units x pieces, unit by unit
};

// With checksums: the CRC-32 and length of each (unit, piece) overlap, combined per job in piece order
// once every unit has landed: the record's checksum without a second pass over its bytes.
struct ChecksumPart {
  uint32_t crc = 0;
  size_t nbytes = 0;
};

struct ScatterPlan {
  std::vector<ScatterPlanJob> jobs;
  size_t unit_bytes;
  size_t scratch_bytes = 0;
  size_t n_parts = 0;

  // The jobs' units, in order; each reads into its part of `scratch` (scratch_bytes) what no straight
  // range takes.
  std::vector<Unit> units(std::byte* scratch) const {
    std::vector<Unit> units;
    for (size_t j = 0; j < jobs.size(); ++j) {
      const ScatterPlanJob& job = jobs[j];
      for (size_t done = 0; job.read_start + done < job.read_stop; done += unit_bytes) {
        size_t n = std::min(unit_bytes, job.read_stop - job.read_start - done);
        size_t need = std::min(n, job.end - (job.read_start + done));
        units.push_back({j, job.fd, job.read_start + done, n, need, scratch + job.scratch_offset + done});
      }
    }
    return units;
  }
};

// Checks jobs[j] and plans its read; its pieces' memory is kept mapped in `regions`.
ScatterPlanJob plan_scatter_job(const char* fn, size_t j, const ScatterJob& job_in, FdStates& fds,
                                std::vector<std::shared_ptr<Region>>& regions) {
  const auto& [fd, file_offset_in, nbytes_in, pieces] = job_in;
  std::string what = "jobs[" + std::to_string(j) + "]";
  if (fd < 0) {
    throw_value_error(fn, what + ": invalid file descriptor " + std::to_string(fd));
  }
  size_t file_offset = to_size(fn, (what + " file_offset").c_str(), file_offset_in);
  size_t nbytes = to_size(fn, (what + " nbytes").c_str(), nbytes_in);
  size_t end = checked_add(fn, file_offset, nbytes);
  FdState* state = fds.get(fd);
  // Direct fds read whole blocks: into the pieces that start and end on one, the rest into the
  // aligned scratch.
  bool direct = state->direct.load();
  ScatterPlanJob job{state, file_offset, end, direct ? align_down(file_offset) : file_offset,
                     direct ? align_up(end) : end, {}, {}};
  for (size_t p = 0; p < pieces.size(); ++p) {
    auto [src_off_in, n_in, dst, dst_off_in] = pieces[p];
    std::string pw = what + " piece " + std::to_string(p);
    if (dst == nullptr) {
      throw_value_error(fn, pw + " has no destination");
    }
    size_t src_off = to_size(fn, (pw + " src_offset").c_str(), src_off_in);
    size_t n = to_size(fn, (pw + " nbytes").c_str(), n_in);
    size_t dst_off = to_size(fn, (pw + " dst_offset").c_str(), dst_off_in);
    if (checked_add(fn, src_off, n) > nbytes) {
      throw_value_error(fn, pw + ": bytes [" + std::to_string(src_off) + ", " + std::to_string(src_off + n) +
                                ") are outside the job's " + std::to_string(nbytes) + " bytes");
    }
    dst->check_range(fn, dst_off, n);
    regions.push_back(dst->region(fn, true));
    job.pieces.push_back({src_off, n, regions.back()->data + dst_off, regions.back().get()});
  }
  job.straight = straight_ranges(job.pieces, file_offset, direct);
  return job;
}

// Checks and plans every job: where each lands in the scratch, its units and its checksum parts.
ScatterPlan plan_scatter(const char* fn, const std::vector<ScatterJob>& jobs, size_t unit_bytes, bool checksums,
                         FdStates& fds, std::vector<std::shared_ptr<Region>>& regions) {
  ScatterPlan plan{{}, unit_bytes};
  size_t n_units = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    ScatterPlanJob& job = plan.jobs.emplace_back(plan_scatter_job(fn, j, jobs[j], fds, regions));
    size_t read_bytes = job.read_stop - job.read_start;
    job.scratch_offset = plan.scratch_bytes;
    plan.scratch_bytes = checked_add(fn, plan.scratch_bytes, align_up(read_bytes));
    job.first_unit = n_units;
    job.n_units = (read_bytes + unit_bytes - 1) / unit_bytes;
    n_units += job.n_units;
    job.first_part = plan.n_parts;
    plan.n_parts += checksums ? job.n_units * job.pieces.size() : 0;
  }
  return plan;
}

// A unit is one preadv: its bytes of the straight ranges into them, the rest (unaligned ends, padding
// outside a run) into the scratch, from where its thread copies them out. A record read into an L0 row
// is read as moe-l2d's loaders read one into a slot, in one run of memory, copying at most its last
// block (docs/benchmarks.md, "Cold misses").
std::optional<OsError> read_scatter_unit(const char* fn, const ScatterPlanJob& job, const Unit& u) {
  const size_t lo = u.file_offset, hi = u.file_offset + u.nbytes;
  for (;;) {
    bool direct = u.fd->direct.load(std::memory_order_relaxed);
    std::vector<iovec> iov;
    size_t at = lo;
    for (const StraightRange& range : job.straight) {
      size_t from = std::max(lo, job.file_offset + range.lo);
      size_t to = std::min(hi, job.file_offset + range.hi);
      if (from >= to) {
        continue;
      }
      if (from > at) {
        iov.push_back({u.dst + (at - lo), from - at});
      }
      iov.push_back({range.dst + (from - job.file_offset - range.lo), to - from});
      at = to;
    }
    if (at < hi) {
      iov.push_back({u.dst + (at - lo), hi - at});
    }
    ssize_t got = preadv_full(u.fd->fd, iov, u.file_offset, direct);
    if (got == -EINVAL && direct) {
      fall_back_to_buffered(*u.fd);  // the iovecs suit a buffered read as well
      continue;
    }
    return unit_result(fn, u, got);
  }
}

// Once u has landed: copies the bytes of the job's pieces that u read into the scratch to them and, with
// `parts` (the unit's, one per piece), checksums each piece's bytes that u read.
void copy_out_unit(const ScatterPlanJob& job, const Unit& u, ChecksumPart* parts) {
  size_t lo = u.file_offset, hi = u.file_offset + u.nbytes;
  for (size_t p = 0; p < job.pieces.size(); ++p) {
    const ScatterPlanPiece& piece = job.pieces[p];
    size_t start = job.file_offset + piece.src_off;  // the piece's first byte in the file
    size_t from = std::max(lo, start);
    size_t to = std::min(hi, start + piece.nbytes);
    if (from >= to) {
      continue;
    }
    size_t at = from;  // bytes before `at` are in place
    for (const StraightRange& range : job.straight) {
      size_t rlo = job.file_offset + range.lo, rhi = job.file_offset + range.hi;
      if (rhi <= at || rlo >= to) {
        continue;
      }
      if (rlo > at) {
        std::memcpy(piece.dst + (at - start), u.dst + (at - lo), rlo - at);
      }
      at = rhi;
    }
    if (at < to) {
      std::memcpy(piece.dst + (at - start), u.dst + (at - lo), to - at);
    }
    if (parts != nullptr) {
      parts[p] = {crc32_update(0, piece.dst + (from - start), to - from), to - from};
    }
  }
}

// Each job's CRC-32 over its pieces in order, from the parts its units computed.
std::vector<uint32_t> job_checksums(const std::vector<ScatterPlanJob>& jobs,
                                    const std::vector<ChecksumPart>& parts) {
  std::vector<uint32_t> sums;
  for (const ScatterPlanJob& job : jobs) {
    uint32_t crc = 0;
    for (size_t p = 0; p < job.pieces.size(); ++p) {
      for (size_t k = 0; k < job.n_units; ++k) {
        const ChecksumPart& part = parts[job.first_part + k * job.pieces.size() + p];
        if (part.nbytes) {
          crc = crc32_concat(crc, part.crc, part.nbytes);
        }
      }
    }
    sums.push_back(crc);
  }
  return sums;
}

}  // namespace

// Each unit's thread reads it, then copies out the bytes of its pieces that no straight range put in place
// and checksums the pieces' bytes it read, so that both overlap the other units' reads.
std::vector<uint32_t> pread_scatter(const std::vector<ScatterJob>& jobs, int threads, int64_t unit_bytes,
                                    bool checksums) {
  const char* fn = "pread_scatter";
  check_threads(fn, threads, unit_bytes);
  std::vector<std::shared_ptr<Region>> regions;  // kept mapped while the GIL is released
  FdStates fds;
  const ScatterPlan plan = plan_scatter(fn, jobs, size_t(unit_bytes), checksums, fds, regions);
  if (plan.scratch_bytes == 0) {  // no job has a byte to read
    return std::vector<uint32_t>(checksums ? jobs.size() : 0, 0);
  }
  Scratch scratch(plan.scratch_bytes);
  if (!scratch) {
    throw OsError(ENOMEM, prefixed(fn, "no memory for " + std::to_string(plan.scratch_bytes) +
                                           " bytes of read buffer"));
  }
  const std::vector<Unit> units = plan.units(scratch.data());
  std::vector<ChecksumPart> parts(plan.n_parts);
  auto failure = run_parallel(units.size(), threads, [&](size_t i) -> std::optional<OsError> {
    const Unit& u = units[i];
    const ScatterPlanJob& job = plan.jobs[u.job];
    if (auto err = read_scatter_unit(fn, job, u)) {
      return err;
    }
    ChecksumPart* unit_parts =
        checksums ? parts.data() + job.first_part + (i - job.first_unit) * job.pieces.size() : nullptr;
    copy_out_unit(job, u, unit_parts);
    return std::nullopt;
  });
  if (failure) {
    throw *failure;
  }
  return checksums ? job_checksums(plan.jobs, parts) : std::vector<uint32_t>{};
}

bool set_direct(int fd, bool enable) {
  const char* fn = "set_direct";
  if (fd < 0) {
    throw_value_error(fn, "invalid file descriptor " + std::to_string(fd));
  }
#if defined(__linux__) && defined(O_DIRECT)
  int flags = fcntl(fd, F_GETFL);
  if (flags == -1) {
    int err = errno;
    throw OsError(err, prefixed(fn, "fcntl(F_GETFL) on " + fd_name(fd) + " failed: " + std::strerror(err)));
  }
  int want = enable ? (flags | O_DIRECT) : (flags & ~O_DIRECT);
  if (want != flags && fcntl(fd, F_SETFL, want) == -1) {
    int err = errno;
    if (enable && err == EINVAL) {
      return false;  // the filesystem has no direct I/O (ramfs, some FUSE mounts, ...)
    }
    throw OsError(err, prefixed(fn, "fcntl(F_SETFL) on " + fd_name(fd) + " failed: " + std::strerror(err)));
  }
  return enable;
#elif defined(__APPLE__)
  if (fcntl(fd, F_NOCACHE, enable ? 1 : 0) == -1) {
    int err = errno;
    throw OsError(err, prefixed(fn, "fcntl(F_NOCACHE) on " + fd_name(fd) + " failed: " + std::strerror(err)));
  }
  return enable;
#else
  (void)enable;
  return false;
#endif
}

int64_t direct_fallbacks() { return g_direct_fallbacks.load(); }

void fail_direct_reads(int64_t n) { g_fail_direct.store(std::max<int64_t>(n, 0)); }

void scatter_straight(bool enable) { g_scatter_straight.store(enable); }

int64_t page_cache_bytes(int fd, int64_t offset_in, int64_t nbytes_in) {
  const char* fn = "page_cache_bytes";
  if (fd < 0) {
    throw_value_error(fn, "invalid file descriptor " + std::to_string(fd));
  }
  size_t offset = to_size(fn, "offset", offset_in);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    throw OsError(err, prefixed(fn, "fstat of " + fd_name(fd) + " failed: " + std::strerror(err)));
  }
  size_t size = size_t(st.st_size);
  size_t end = nbytes_in < 0 ? size : std::min(size, checked_add(fn, offset, size_t(nbytes_in)));
  if (offset >= end) {
    return 0;
  }
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t chunk = size_t(1) << 30;
  size_t resident = 0;
  std::optional<OsError> failure;
  {
    nb::gil_scoped_release unlocked;
#ifdef __APPLE__
    std::vector<char> vec;
#else
    std::vector<unsigned char> vec;
#endif
    for (size_t at = offset / page * page; at < end && !failure; at += chunk) {
      size_t len = std::min(chunk, end - at);
      void* addr = mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(at));
      if (addr == MAP_FAILED) {
        int err = errno;
        failure = OsError(err, prefixed(fn, "mmap of " + fd_name(fd) + " failed: " + std::strerror(err)));
        break;
      }
      vec.assign((len + page - 1) / page, 0);
      if (mincore(addr, len, vec.data()) != 0) {
        int err = errno;
        failure = OsError(err, prefixed(fn, "mincore failed: " + std::string(std::strerror(err))));
      } else {
        for (size_t i = 0; i < vec.size(); ++i) {
          if (vec[i] & 1) {
            size_t lo = std::max(at + i * page, offset);
            size_t hi = std::min(at + (i + 1) * page, end);
            resident += hi > lo ? hi - lo : 0;
          }
        }
      }
      munmap(addr, len);
    }
  }
  if (failure) {
    throw *failure;
  }
  return int64_t(resident);
}

}  // namespace moe_l2
