// The learned eviction policy's model of one layer (src/moe_l2/cache/learned.py, whose docstring is its maths): the
// weights and their RMSprop state, the decayed pick counts, each client's history and latest chances, and the batches
// whose labels are not known yet. One observe() a batch learns from the batches due and scores every expert.
// Every float32 number is computed one rounding an operation and none fused (the build turns floating-point
// contraction off), in the order numpy's float32 ufuncs computed it before; log1p and the logistic in double through
// libm, rounded once: tests/test_learned.py's numpy reference computes the same to the bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace moe_l2 {

struct LearnedSettings {
  std::vector<float> count_decay;         // per decayed count: its decay a batch (2^(-1/half-life), float32)
  std::vector<double> horizon_multiples;  // of the cache's lifetime in batches
  int64_t lifetime_low, lifetime_high;    // the lifetime's range
  float rate;                             // RMSprop's
  double rms_decay;                       // (its 1 - decay rounded once from the double, as numpy did)
  float eps;
  float history_decay, history_floor;     // a client's decayed picks, and the least that counts
  size_t max_sources;
  int64_t source_ttl;  // horizons
};

struct RmsProp {  // an RMSprop step's numbers, as float32 operands
  float rate;   // the learning rate
  float decay;  // of the mean squares
  float keep;   // 1 - decay, computed in double and rounded once, as numpy rounds a Python float
  float eps;    // beside the root of the mean squares
};

class LearnedModel {
 public:
  LearnedModel(size_t n_experts, LearnedSettings settings);

  size_t n() const { return n_; }
  size_t horizons() const { return settings_.horizon_multiples.size(); }
  size_t n_features() const { return 2 + settings_.count_decay.size(); }  // picked now, the counts, the bias
  size_t n_counts() const { return settings_.count_decay.size(); }

  // The weights [horizons, features, n] and [horizons, n, n] (cross, history, before), their mean squares alike,
  // and the decayed counts [counts, n]: what a state keeps.
  std::vector<float> own, own_ms, cross, cross_ms, history, history_ms, before, before_ms, counts;
  int64_t clock = 0;
  double batch_mean = 0.0;

  // About how long an expert stays in `capacity` slots, in batches: the horizons are multiples of it.
  int64_t lifetime(size_t capacity) const;

  // One batch: `picked` (distinct, ascending, each < n) of client `source`, whose latest picks at the layer before
  // were `context` (distinct, ascending; empty: none known). Fills `score` with each expert's chance of a pick by any
  // recent client summed over the horizons, and `gone` with the clients let go. std::invalid_argument where an
  // expert is not one of the layer's.
  void observe(const std::vector<int64_t>& picked, int64_t source, const std::vector<int64_t>& context,
               size_t capacity, std::vector<float>& score, std::vector<int64_t>& gone);

  // The client's latest batch, while it counts as recent (false where it does not).
  bool latest(int64_t source, std::vector<int64_t>& batch) const;
  // The client's latest chances [horizons, n] (false where it has none).
  bool chances(int64_t source, std::vector<float>& out) const;
  // Bytes of its clients and pending batches now (the weights apart).
  size_t dynamic_bytes() const;
  std::vector<size_t> pending_sizes() const;
  std::vector<int64_t> sources() const;  // least recent first

 private:
  using Picks = std::shared_ptr<std::vector<int64_t>>;  // a client's latest pick of each expert: the labels

  struct Scored {  // a batch's scores, kept until each horizon's label is known
    std::vector<int64_t> batch, past_ids, before;
    std::vector<float> past_weights, features, chances;  // [features, n] and [horizons, n]
    int64_t clock;
    Picks last_picked;
  };

  struct Source {
    int64_t id;
    std::vector<int64_t> batch;
    int64_t clock;
    std::vector<float> past;
    Picks last_picked;
    std::vector<float> chances;  // empty until scored
  };

  Source& source(int64_t id, const std::vector<int64_t>& batch, int64_t lifetime, std::vector<int64_t>& gone);
  void learn(const std::vector<std::pair<size_t, const Scored*>>& due);
  void step(std::vector<float>& weights, std::vector<float>& mean_squares, size_t rows_per_horizon, size_t k,
            int64_t row, const float* error, const float* factor, float scale) const;
  std::shared_ptr<Scored> score_batch(const std::vector<int64_t>& picked, const Source& mine,
                                      const std::vector<int64_t>& context);
  void combine(std::vector<float>& score) const;

  size_t n_;
  LearnedSettings settings_;
  RmsProp rmsprop_;
  std::vector<std::deque<std::shared_ptr<Scored>>> pending_;  // per horizon, oldest first
  std::vector<Source> sources_;                                 // least recent first
};

}  // namespace moe_l2
