#include "background.h"

#if defined(__linux__)
#include <sched.h>
#elif defined(__APPLE__)
#include <pthread/qos.h>
#endif

namespace moe_l2 {

const char* run_in_background() {
#if defined(__linux__)
  sched_param param{};
  // pid 0: the calling thread (Linux schedules threads, not processes).
  return sched_setscheduler(0, SCHED_IDLE, &param) == 0 ? "SCHED_IDLE" : "";
#elif defined(__APPLE__)
  return pthread_set_qos_class_self_np(QOS_CLASS_UTILITY, 0) == 0 ? "QOS_CLASS_UTILITY" : "";
#else
  return "";
#endif
}

}  // namespace moe_l2
