#include "word_wait.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#elif defined(__APPLE__)
#include <dlfcn.h>
#endif

namespace moe_l2 {

namespace {

// Where nothing can sleep on the word: look at it again this often.
constexpr int64_t kPollNs = 100'000;

[[maybe_unused]] void poll_word(const int32_t* word, int32_t expected, int64_t timeout_ns) {
  using clock = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::nanoseconds(timeout_ns);
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == expected) {
    auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) {
      return;
    }
    std::this_thread::sleep_for(std::min<clock::duration>(left, std::chrono::nanoseconds(kPollNs)));
  }
}

#if defined(__APPLE__)
// Looked up at run time: the extension targets macOS 14.0, os_sync_* came with 14.4, and __ulock_* are libSystem's
// private traps (what os_sync_* wrap). The values are those of <os/os_sync_wait_on_address.h>, <os/clock.h> and
// xnu's <sys/ulock.h>.
constexpr uint32_t kOsSyncShared = 1;            // OS_SYNC_WAIT_ON_ADDRESS_SHARED, OS_SYNC_WAKE_BY_ADDRESS_SHARED
constexpr uint32_t kMachAbsoluteTime = 32;       // OS_CLOCK_MACH_ABSOLUTE_TIME
constexpr uint32_t kUlCompareAndWaitShared = 3;  // UL_COMPARE_AND_WAIT_SHARED
constexpr uint32_t kUlfWakeAll = 0x100;          // ULF_WAKE_ALL
constexpr uint32_t kUlfNoErrno = 0x01000000;     // ULF_NO_ERRNO

struct Darwin {
  int (*os_wait)(void*, uint64_t, size_t, uint32_t, uint32_t, uint64_t);  // ..._with_timeout: relative ns
  int (*os_wake)(void*, size_t, uint32_t);
  int (*ulock_wait)(uint32_t, void*, uint64_t, uint32_t);  // timeout in us, 0 = none
  int (*ulock_wake)(uint32_t, void*, uint64_t);

  bool os_sync() const { return os_wait != nullptr && os_wake != nullptr; }
  bool ulock() const { return ulock_wait != nullptr && ulock_wake != nullptr; }
};

template <typename F>
F lookup(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

const Darwin& darwin() {
  static const Darwin d{
      lookup<decltype(Darwin::os_wait)>("os_sync_wait_on_address_with_timeout"),
      lookup<decltype(Darwin::os_wake)>("os_sync_wake_by_address_all"),
      lookup<decltype(Darwin::ulock_wait)>("__ulock_wait"),
      lookup<decltype(Darwin::ulock_wake)>("__ulock_wake"),
  };
  return d;
}
#endif

}  // namespace

#if defined(__linux__)

void wait_on_word(const int32_t* word, int32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)};
  // Not FUTEX_PRIVATE_FLAG: other processes map the word. EAGAIN (it differs), EINTR, ETIMEDOUT: all a return.
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void wake_word(int32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

const char* word_wait_kind() { return "futex"; }

#elif defined(__APPLE__)

void wait_on_word(const int32_t* word, int32_t expected, int64_t timeout_ns) {
  const Darwin& d = darwin();
  void* address = const_cast<int32_t*>(word);  // never written through: the calls only compare and sleep
  uint64_t value = static_cast<uint32_t>(expected);  // a 4-byte word's value, not sign-extended
  if (d.os_sync()) {
    d.os_wait(address, value, sizeof(int32_t), kOsSyncShared, kMachAbsoluteTime, uint64_t(timeout_ns));
  } else if (d.ulock()) {
    auto us = std::clamp<int64_t>(timeout_ns / 1000, 1, UINT32_MAX);
    d.ulock_wait(kUlCompareAndWaitShared | kUlfNoErrno, address, value, static_cast<uint32_t>(us));
  } else {
    poll_word(word, expected, timeout_ns);
  }
}

void wake_word(int32_t* word) {
  const Darwin& d = darwin();
  if (d.os_sync()) {
    d.os_wake(word, sizeof(int32_t), kOsSyncShared);
  } else if (d.ulock()) {
    d.ulock_wake(kUlCompareAndWaitShared | kUlfWakeAll | kUlfNoErrno, word, 0);
  }
}

const char* word_wait_kind() {
  const Darwin& d = darwin();
  return d.os_sync() ? "os_sync" : d.ulock() ? "ulock" : "poll";
}

#else

void wait_on_word(const int32_t* word, int32_t expected, int64_t timeout_ns) {
  poll_word(word, expected, timeout_ns);
}

void wake_word(int32_t*) {}

const char* word_wait_kind() { return "poll"; }

#endif

}  // namespace moe_l2
