// Sleeping on a 32-bit word of shared memory until another process changes it and wakes the word's waiters:
// Linux's futex, macOS' os_sync_wait_on_address (14.4 and later) or __ulock_wait before it, each in its shared
// form (the word lies in a MAP_SHARED segment), and a short poll where none of them is there. A wait is only a
// wake-up: it may also end early (a signal, a wake for another change), so the caller looks at the word, and at
// what it guards, again afterwards.
#pragma once

#include <cstdint>

namespace moe_l2 {

// Sleeps while *word == expected, for at most timeout_ns (> 0); returns at once where it differs already.
void wait_on_word(const int32_t* word, int32_t expected, int64_t timeout_ns);
// Wakes every waiter on the word, in every process that maps it.
void wake_word(int32_t* word);
// What wait_on_word sleeps with in this process: "futex", "os_sync", "ulock" or "poll".
const char* word_wait_kind();

}  // namespace moe_l2
