#include "learned.h"

#include <cmath>

namespace moe_l2 {

namespace {

// g(e) is the gradient of weight e; one loop per kind of g, so that the compiler vectorizes each.
template <typename Gradient>
void step(float* __restrict w, float* __restrict ms, size_t n, const RmsProp& p, Gradient g) {
  for (size_t e = 0; e < n; ++e) {
    const float grad = g(e);
    const float mean_square = ms[e] * p.decay + (p.keep * grad) * grad;
    ms[e] = mean_square;
    w[e] -= (p.rate * grad) / (std::sqrt(mean_square) + p.eps);
  }
}

// sum[e] = the picked rows of horizon k summed in order from 0 (0 + x is x but for the sign of a zero, which no
// logit's use tells apart), each times weight[i] where weights are given.
void sum_rows(const Picked& p, size_t k, size_t rows_per_horizon, const float* weight, size_t n,
              float* __restrict sum) {
  for (size_t e = 0; e < n; ++e) {
    sum[e] = 0.0f;
  }
  for (size_t i = 0; i < p.count; ++i) {
    const float* row = p.weights + (k * rows_per_horizon + size_t(p.rows[i])) * n;
    const float w = weight != nullptr ? weight[i] : 1.0f;  // 1 * x is x
    for (size_t e = 0; e < n; ++e) {
      sum[e] = sum[e] + w * row[e];
    }
  }
}

}  // namespace

void rmsprop_row(float* w, float* ms, const float* error, const float* factor, float scale, size_t n,
                 const RmsProp& p) {
  if (factor != nullptr) {
    step(w, ms, n, p, [=](size_t e) { return factor[e] * error[e]; });
  } else {
    step(w, ms, n, p, [=](size_t e) { return scale * error[e]; });
  }
}

void learned_logits(const float* own, const float* features, size_t n_features, const Picked& cross,
                    const Picked& before, const Picked& history, const float* past_weights, size_t horizons,
                    size_t n, float* out) {
  std::vector<float> picked(n), context(n), past(n);
  for (size_t k = 0; k < horizons; ++k) {
    float* logits = out + k * n;
    const float* own_k = own + k * n_features * n;
    for (size_t e = 0; e < n; ++e) {
      logits[e] = own_k[e] * features[e];
    }
    for (size_t f = 1; f < n_features; ++f) {
      for (size_t e = 0; e < n; ++e) {
        logits[e] = logits[e] + own_k[f * n + e] * features[f * n + e];
      }
    }
    sum_rows(cross, k, n, nullptr, n, picked.data());
    sum_rows(before, k, n, nullptr, n, context.data());
    sum_rows(history, k, n, past_weights, n, past.data());
    for (size_t e = 0; e < n; ++e) {
      logits[e] = ((logits[e] + picked[e]) + context[e]) + past[e];
    }
  }
}

}  // namespace moe_l2
