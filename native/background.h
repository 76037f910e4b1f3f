// A thread whose work can wait for any other thread's: Linux's SCHED_IDLE (it runs where a core would idle
// otherwise) or macOS' utility QoS class. The donor's copies into L2 (client/donor.py) take it, so that they never
// delay the wake-up of a read the token waits on (docs/decisions.md, "Fills").
#pragma once

namespace moe_l2 {

// Puts the calling thread in the background class for good; returns the class ("SCHED_IDLE",
// "QOS_CLASS_UTILITY"), or "" where the platform refused it or has none.
const char* run_in_background();

}  // namespace moe_l2
