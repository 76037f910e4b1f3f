// L3 reads: parallel pread of record pieces (pread_records), direct I/O turned on and off (set_direct), and a
// page-cache probe (mincore) for benchmarks. The units they are read in and their direct I/O: read_units.h;
// one read per record scattered into its pieces: scatter.cpp.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nanobind/nanobind.h>

#include "read_units.h"
#include "records.h"

namespace nb = nanobind;

namespace moe_l2 {

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
