// One read per record scattered into its pieces (pread_scatter): one preadv a unit, straight into the
// pieces where alignment allows, the rest through aligned scratch memory and copied out, checksummed as it
// lands.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>

#include "crc32.h"
#include "read_units.h"
#include "records.h"

namespace moe_l2 {

namespace {

std::atomic<bool> g_scatter_straight{true};  // bench hook: false reads every piece through the scratch

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

// The word each job sets as it lands, and how many units each job still waits for.
struct Landed {
  std::vector<uint32_t*> words;
  int fd = -1;
  std::unique_ptr<std::atomic<size_t>[]> left;  // per job its units not landed, then the jobs not landed

  // The call's last job to land wakes no one: the call returns with it, and its caller says so.
  void unit_done(size_t job) {
    if (!words.empty() && left[job].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      __atomic_store_n(words[job], 1u, __ATOMIC_RELEASE);
      if (left[words.size()].fetch_sub(1, std::memory_order_acq_rel) != 1) {
        write_wake(fd);
      }
    }
  }
};

Landed landed_words(const char* fn, Memory* landed, const std::vector<int64_t>& at, int fd, const ScatterPlan& plan,
                    std::vector<std::shared_ptr<Region>>& regions) {
  Landed signal;
  if (landed == nullptr) {
    return signal;
  }
  if (fd < 0 || at.size() != plan.jobs.size()) {
    throw_value_error(fn, "landed needs landed_fd, the descriptor to wake, and landed_at, a word for each of the " +
                              std::to_string(plan.jobs.size()) + " jobs; got " + std::to_string(at.size()));
  }
  regions.push_back(landed->region(fn, true));
  for (size_t j = 0; j < at.size(); ++j) {
    size_t off = checked_mul(fn, to_size(fn, "landed_at", at[j]), 4);
    landed->check_range(fn, off, 4);
    signal.words.push_back(reinterpret_cast<uint32_t*>(regions.back()->data + off));
  }
  if (reinterpret_cast<uintptr_t>(regions.back()->data) % alignof(uint32_t) != 0) {
    throw_value_error(fn, "landed's words are not 4-byte aligned");
  }
  signal.fd = fd;
  signal.left.reset(new std::atomic<size_t>[plan.jobs.size() + 1]);
  for (size_t j = 0; j < plan.jobs.size(); ++j) {
    signal.left[j].store(plan.jobs[j].n_units);
  }
  signal.left[plan.jobs.size()].store(plan.jobs.size());
  return signal;
}

}  // namespace

// Each unit's thread reads it, then copies out the bytes of its pieces that no straight range put in place
// and checksums the pieces' bytes it read, so that both overlap the other units' reads.
std::vector<uint32_t> pread_scatter(const std::vector<ScatterJob>& jobs, int threads, int64_t unit_bytes,
                                    bool checksums, Memory* landed, const std::vector<int64_t>& landed_at,
                                    int landed_fd) {
  const char* fn = "pread_scatter";
  check_threads(fn, threads, unit_bytes);
  std::vector<std::shared_ptr<Region>> regions;  // kept mapped while the GIL is released
  FdStates fds;
  const ScatterPlan plan = plan_scatter(fn, jobs, size_t(unit_bytes), checksums, fds, regions);
  Landed signal = landed_words(fn, landed, landed_at, landed_fd, plan, regions);
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
    signal.unit_done(u.job);
    return std::nullopt;
  });
  if (failure) {
    throw *failure;
  }
  return checksums ? job_checksums(plan.jobs, parts) : std::vector<uint32_t>{};
}

void scatter_straight(bool enable) { g_scatter_straight.store(enable); }

}  // namespace moe_l2
