#include "learned.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>

namespace moe_l2 {

namespace {

// g(e) is the gradient of weight e; one loop per kind of g, so that the compiler vectorizes each.
template <typename Gradient>
void rmsprop(float* __restrict w, float* __restrict ms, size_t n, const RmsProp& p, Gradient g) {
  for (size_t e = 0; e < n; ++e) {
    const float grad = g(e);
    const float mean_square = ms[e] * p.decay + (p.keep * grad) * grad;
    ms[e] = mean_square;
    w[e] -= (p.rate * grad) / (std::sqrt(mean_square) + p.eps);
  }
}

// sum[e] = rows `ids` of horizon k's [n, n] weights summed in order from 0 (0 + x is x but for the sign of a zero,
// which no logit's use tells apart), each times weight[i] where weights are given.
void sum_rows(const std::vector<float>& weights, size_t k, const std::vector<int64_t>& ids, const float* weight,
              size_t n, float* __restrict sum) {
  std::fill(sum, sum + n, 0.0f);
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* row = weights.data() + (k * n + size_t(ids[i])) * n;
    const float w = weight != nullptr ? weight[i] : 1.0f;  // 1 * x is x
    for (size_t e = 0; e < n; ++e) {
      sum[e] = sum[e] + w * row[e];
    }
  }
}

float logistic(float x) { return float(1.0 / (1.0 + std::exp(-double(x)))); }

void check_experts(const std::vector<int64_t>& ids, size_t n, const char* what) {
  int64_t before = -1;
  for (int64_t e : ids) {
    if (e < 0 || size_t(e) >= n || e <= before) {
      throw std::invalid_argument(std::string(what) + " must be distinct experts 0.." + std::to_string(n - 1) +
                                  " in ascending order: " + std::to_string(e) +
                                  (e <= before && e >= 0 ? " after " + std::to_string(before) : " is not one"));
    }
    before = e;
  }
}

}  // namespace

LearnedModel::LearnedModel(size_t n_experts, LearnedSettings settings)
    : n_(n_experts),
      settings_(std::move(settings)),
      rmsprop_{settings_.rate, float(settings_.rms_decay), float(1.0 - settings_.rms_decay), settings_.eps},
      pending_(settings_.horizon_multiples.size()) {
  const size_t k = horizons(), pairs = k * n_ * n_;
  own.assign(k * n_features() * n_, 0.0f);
  own_ms = own;
  for (auto* paired : {&cross, &cross_ms, &history, &history_ms, &before, &before_ms}) {
    paired->assign(pairs, 0.0f);
  }
  counts.assign(n_counts() * n_, 0.0f);
}

int64_t LearnedModel::lifetime(size_t capacity) const {
  if (batch_mean <= 0) {
    return settings_.lifetime_low;
  }
  // Python's round: to the nearest, ties to even (the default rounding mode).
  const auto rounded = int64_t(std::nearbyint(double(capacity) / batch_mean));
  return std::min(settings_.lifetime_high, std::max(settings_.lifetime_low, rounded));
}

void LearnedModel::observe(const std::vector<int64_t>& picked, int64_t source, const std::vector<int64_t>& context,
                           size_t capacity, std::vector<float>& score, std::vector<int64_t>& gone) {
  check_experts(picked, n_, "a batch");
  check_experts(context, n_, "a context");
  if (picked.empty()) {
    throw std::invalid_argument("a batch must pick at least one expert");
  }
  clock += 1;
  batch_mean += (double(picked.size()) - batch_mean) / double(std::min<int64_t>(clock, 256));
  const int64_t life = lifetime(capacity);
  Source& mine = this->source(source, picked, life, gone);
  for (int64_t e : picked) {
    (*mine.last_picked)[e] = clock;
  }
  // One step for all horizons at once (they own disjoint weights); a horizon that shrank may have several batches
  // due, learned from in turn.
  std::vector<std::vector<std::shared_ptr<Scored>>> due(horizons());
  size_t steps = 0;
  for (size_t k = 0; k < horizons(); ++k) {
    const auto h = std::max<int64_t>(1, int64_t(std::nearbyint(settings_.horizon_multiples[k] * double(life))));
    auto& pending = pending_[k];
    while (!pending.empty() && clock - pending.front()->clock >= h) {
      due[k].push_back(std::move(pending.front()));
      pending.pop_front();
    }
    steps = std::max(steps, due[k].size());
  }
  for (size_t i = 0; i < steps; ++i) {
    std::vector<std::pair<size_t, const Scored*>> group;
    for (size_t k = 0; k < horizons(); ++k) {
      if (i < due[k].size()) {
        group.emplace_back(k, due[k][i].get());
      }
    }
    learn(group);
  }
  auto scored = score_batch(picked, mine, context);
  for (auto& pending : pending_) {
    pending.push_back(scored);
  }
  mine.chances = scored->chances;
  combine(score);
}

LearnedModel::Source& LearnedModel::source(int64_t id, const std::vector<int64_t>& batch, int64_t lifetime,
                                           std::vector<int64_t>& gone) {
  auto it = std::find_if(sources_.begin(), sources_.end(), [&](const Source& s) { return s.id == id; });
  if (it == sources_.end()) {
    sources_.push_back({id, batch, clock, std::vector<float>(n_, 0.0f),
                        std::make_shared<std::vector<int64_t>>(n_, 0), {}});
  } else {
    const float decay = settings_.history_decay;
    for (float& p : it->past) {
      p = p * decay;
    }
    for (int64_t e : it->batch) {
      it->past[e] = it->past[e] + decay;
    }
    it->batch = batch;
    it->clock = clock;
    std::rotate(it, it + 1, sources_.end());  // the most recent last
  }
  const int64_t stale = clock - settings_.source_ttl * lifetime;
  while (sources_.size() > settings_.max_sources || sources_.front().clock < stale) {
    gone.push_back(sources_.front().id);
    sources_.erase(sources_.begin());
  }
  return sources_.back();
}

void LearnedModel::step(std::vector<float>& weights, std::vector<float>& mean_squares, size_t rows_per_horizon,
                        size_t k, int64_t row, const float* error, const float* factor, float scale) const {
  const RmsProp& p = rmsprop_;
  const size_t at = (k * rows_per_horizon + size_t(row)) * n_;
  float* w = weights.data() + at;
  float* ms = mean_squares.data() + at;
  if (factor != nullptr) {
    rmsprop(w, ms, n_, p, [=](size_t e) { return factor[e] * error[e]; });
  } else {
    rmsprop(w, ms, n_, p, [=](size_t e) { return scale * error[e]; });
  }
}

void LearnedModel::learn(const std::vector<std::pair<size_t, const Scored*>>& due) {
  // The error of each batch's chances for h_k: has its client picked each expert since.
  std::vector<std::vector<float>> errors;
  for (const auto& [k, s] : due) {
    std::vector<float> error(n_);
    for (size_t e = 0; e < n_; ++e) {
      error[e] = s->chances[k * n_ + e] - ((*s->last_picked)[e] > s->clock ? 1.0f : 0.0f);
    }
    errors.push_back(std::move(error));
  }
  const size_t f = n_features();
  for (size_t i = 0; i < due.size(); ++i) {
    for (size_t j = 0; j < f; ++j) {
      step(own, own_ms, f, due[i].first, int64_t(j), errors[i].data(), due[i].second->features.data() + j * n_, 1);
    }
  }
  for (size_t i = 0; i < due.size(); ++i) {
    for (int64_t row : due[i].second->batch) {
      step(cross, cross_ms, n_, due[i].first, row, errors[i].data(), nullptr, 1.0f);
    }
  }
  for (size_t i = 0; i < due.size(); ++i) {
    for (int64_t row : due[i].second->before) {
      step(before, before_ms, n_, due[i].first, row, errors[i].data(), nullptr, 1.0f);
    }
  }
  for (size_t i = 0; i < due.size(); ++i) {
    const Scored& s = *due[i].second;
    for (size_t j = 0; j < s.past_ids.size(); ++j) {
      step(history, history_ms, n_, due[i].first, s.past_ids[j], errors[i].data(), nullptr, s.past_weights[j]);
    }
  }
}

std::shared_ptr<LearnedModel::Scored> LearnedModel::score_batch(const std::vector<int64_t>& picked,
                                                                const Source& mine,
                                                                const std::vector<int64_t>& context) {
  auto scored = std::make_shared<Scored>();
  Scored& s = *scored;
  s.batch = picked;
  s.before = context;
  s.clock = clock;
  s.last_picked = mine.last_picked;
  const size_t n = n_, c = n_counts(), f = n_features();
  s.features.assign(f * n, 0.0f);
  for (int64_t e : picked) {
    s.features[e] = 1.0f;
  }
  for (size_t r = 0; r < c; ++r) {
    const float decay = settings_.count_decay[r];
    for (size_t e = 0; e < n; ++e) {
      float& count = counts[r * n + e];
      count = count * decay;
      count = count + s.features[e];
      s.features[(1 + r) * n + e] = float(std::log1p(double(count)));
    }
  }
  std::fill(s.features.begin() + (f - 1) * n, s.features.end(), 1.0f);  // the bias'
  for (size_t e = 0; e < n; ++e) {
    if (mine.past[e] >= settings_.history_floor) {
      s.past_ids.push_back(int64_t(e));
      s.past_weights.push_back(mine.past[e]);
    }
  }
  // z_ke: ((own . features) + the batch's cross rows + its context's before rows) + the past picks' history rows.
  s.chances.assign(horizons() * n, 0.0f);
  std::vector<float> batch_sum(n), context_sum(n), past_sum(n);
  for (size_t k = 0; k < horizons(); ++k) {
    float* logits = s.chances.data() + k * n;
    const float* own_k = own.data() + k * f * n;
    for (size_t e = 0; e < n; ++e) {
      logits[e] = own_k[e] * s.features[e];
    }
    for (size_t g = 1; g < f; ++g) {
      for (size_t e = 0; e < n; ++e) {
        logits[e] = logits[e] + own_k[g * n + e] * s.features[g * n + e];
      }
    }
    sum_rows(cross, k, s.batch, nullptr, n, batch_sum.data());
    sum_rows(before, k, s.before, nullptr, n, context_sum.data());
    sum_rows(history, k, s.past_ids, s.past_weights.data(), n, past_sum.data());
    for (size_t e = 0; e < n; ++e) {
      logits[e] = logistic(((logits[e] + batch_sum[e]) + context_sum[e]) + past_sum[e]);
    }
  }
  return scored;
}

void LearnedModel::combine(std::vector<float>& score) const {
  // The chance of a pick of e within h_k by any recent client: 1 - prod over clients of (1 - p_cke).
  std::vector<const std::vector<float>*> chances;
  for (const Source& s : sources_) {
    if (!s.chances.empty()) {
      chances.push_back(&s.chances);
    }
  }
  const size_t n = n_, cells = horizons() * n;
  std::vector<float> any(cells);
  for (size_t i = 0; i < cells; ++i) {
    if (chances.size() == 1) {
      any[i] = (*chances[0])[i];
      continue;
    }
    float none = 1.0f - (*chances[0])[i];
    for (size_t c = 1; c < chances.size(); ++c) {
      none = none * (1.0f - (*chances[c])[i]);
    }
    any[i] = 1.0f - none;
  }
  score.assign(any.begin(), any.begin() + n);
  for (size_t k = 1; k < horizons(); ++k) {
    for (size_t e = 0; e < n; ++e) {
      score[e] = score[e] + any[k * n + e];
    }
  }
}

bool LearnedModel::latest(int64_t source, std::vector<int64_t>& batch) const {
  for (const Source& s : sources_) {
    if (s.id == source) {
      batch = s.batch;
      return true;
    }
  }
  return false;
}

bool LearnedModel::chances(int64_t source, std::vector<float>& out) const {
  for (const Source& s : sources_) {
    if (s.id == source && !s.chances.empty()) {
      out = s.chances;
      return true;
    }
  }
  return false;
}

size_t LearnedModel::dynamic_bytes() const {
  const size_t n = n_, cells = horizons() * n;
  size_t bytes = 0;
  std::set<const void*> held;
  for (const Source& s : sources_) {
    bytes += 8 * s.batch.size() + 4 * n + 8 * n + 4 * s.chances.size();
    held.insert(s.last_picked.get());
  }
  std::set<const void*> seen;  // the horizons share each batch, and a client let go lives on in its batches' labels
  for (const auto& pending : pending_) {
    for (const auto& s : pending) {
      if (seen.insert(s.get()).second) {
        bytes += 8 * (s->batch.size() + s->past_ids.size() + s->before.size()) + 4 * s->past_weights.size() +
                 4 * (s->features.size() + cells);
      }
      if (held.insert(s->last_picked.get()).second) {
        bytes += 8 * n;
      }
    }
  }
  return bytes;
}

std::vector<size_t> LearnedModel::pending_sizes() const {
  std::vector<size_t> sizes;
  for (const auto& pending : pending_) {
    sizes.push_back(pending.size());
  }
  return sizes;
}

std::vector<int64_t> LearnedModel::sources() const {
  std::vector<int64_t> ids;
  for (const Source& s : sources_) {
    ids.push_back(s.id);
  }
  return ids;
}

}  // namespace moe_l2
