// The learned eviction policy's arithmetic (src/moe_l2/cache/learned.py): a batch's logits (LearnedReuse._observe)
// and the RMSprop step of its weights (LearnedReuse._learn). Each number is computed as numpy's float32 ufuncs
// computed it before: the same operations in the same order, one rounding each and none fused (the build turns
// floating-point contraction off), so that a run scores and learns the same to the bit (tests/test_learned.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe_l2 {

struct RmsProp {
  float rate;   // the learning rate
  float decay;  // of the mean squares
  float keep;   // 1 - decay, computed in double and rounded once, as numpy rounds a Python float
  float eps;    // beside the root of the mean squares
};

// One step of the n weights w and their mean squares ms on the gradient factor[e] * error[e], or scale * error[e]
// where factor is null.
void rmsprop_row(float* w, float* ms, const float* error, const float* factor, float scale, size_t n,
                 const RmsProp& p);

// Rows of a [horizons, rows, n] float32 array, the same rows in every horizon.
struct Picked {
  const float* weights;
  const int64_t* rows;
  size_t count;
};

// logits[k, e] for k < horizons, e < n: ((own . features) + the batch's cross rows + its context's before rows) +
// the history rows of its past picks, each times its weight; every sum in row order, from its first term (an empty
// one is 0). own: [horizons, n_features, n], features: [n_features, n], out: [horizons, n].
void learned_logits(const float* own, const float* features, size_t n_features, const Picked& cross,
                    const Picked& before, const Picked& history, const float* past_weights, size_t horizons,
                    size_t n, float* out);

}  // namespace moe_l2
