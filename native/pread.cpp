#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

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

// Jobs are cut into units of at most this many bytes, so that one large record is read by
// several threads at once (SSDs want a deep queue) and no single pread nears the OS limits.
constexpr size_t kUnitBytes = size_t(8) << 20;

struct Unit {
  size_t job;
  int fd;
  uint64_t file_offset;
  size_t nbytes;
  std::byte* dst;
};

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

// Reads one unit completely: short reads continue where they stopped, EINTR retries.
// Returns the error, or nothing on success.
std::optional<OsError> read_unit(const Unit& u) {
  size_t done = 0;
  while (done < u.nbytes) {
    ssize_t n = pread(u.fd, u.dst + done, u.nbytes - done, static_cast<off_t>(u.file_offset + done));
    if (n > 0) {
      done += size_t(n);
      continue;
    }
    std::string where = "job " + std::to_string(u.job) + ": bytes [" +
                        std::to_string(u.file_offset + done) + ", " +
                        std::to_string(u.file_offset + u.nbytes) + ") of " + fd_name(u.fd);
    if (n == 0) {
      struct stat st;
      std::string size = fstat(u.fd, &st) == 0 ? " (it has " + std::to_string(st.st_size) + " bytes)" : "";
      return OsError(0, prefixed("pread_records", "unexpected end of file in " + where + size +
                                                      ": truncated model file?"));
    }
    int err = errno;
    if (err == EINTR) {
      continue;
    }
    return OsError(err, prefixed("pread_records", "reading " + where + " failed: " +
                                                      std::strerror(err)));
  }
  return std::nullopt;
}

}  // namespace

void pread_records(const std::vector<ReadJob>& jobs, int threads) {
  const char* fn = "pread_records";
  if (threads < 1) {
    throw_value_error(fn, "threads must be >= 1, got " + std::to_string(threads));
  }
  std::vector<std::shared_ptr<Region>> regions;  // kept mapped while the GIL is released
  std::vector<Unit> units;
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
    for (size_t done = 0; done < nbytes; done += kUnitBytes) {
      units.push_back({j, fd, file_offset + done, std::min(kUnitBytes, nbytes - done), out + done});
    }
  }

  std::optional<OsError> failure;
  {
    nb::gil_scoped_release unlocked;
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex failure_lock;
    auto work = [&] {
      for (size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < units.size();) {
        if (auto err = read_unit(units[i])) {
          std::lock_guard<std::mutex> lock(failure_lock);
          if (!failure) {
            failure = std::move(err);
          }
          failed.store(true, std::memory_order_relaxed);
        }
      }
    };
    size_t n_threads = std::min(units.size(), size_t(threads));
    if (n_threads <= 1) {
      work();
    } else {
      std::vector<std::thread> pool;
      try {
        for (size_t t = 1; t < n_threads; ++t) {
          pool.emplace_back(work);
        }
      } catch (const std::system_error&) {
        // Out of threads: the ones started and this one share the work.
      }
      work();
      for (auto& t : pool) {
        t.join();
      }
    }
  }
  if (failure) {
    throw *failure;
  }
}

}  // namespace moe_l2
