// GGUF (llama.cpp) tensors -> MLX's own layout, with the GIL released.
//
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks hold 32 weights with a float16 scale (and, for the _1
// types, a float16 minimum), so each block is exactly one group of MLX's affine quantization
// with group size 32:
//   Q4_0  w = d * (q - 8)    -> scale d, bias -8 d,   q in [0, 16)
//   Q4_1  w = d * q + m      -> scale d, bias m
//   Q5_0  w = d * (q - 16)   -> scale d, bias -16 d,  q in [0, 32)
//   Q5_1  w = d * q + m      -> scale d, bias m
//   Q8_0  w = d * q (int8)   -> scale d, bias -128 d, stored q + 128 in [0, 256)
// The biases are computed in float32 and rounded to float16, which is exact (a power-of-two
// multiple) unless it overflows, as in mx.load. MXFP4 blocks (an e8m0 exponent and 32 e2m1
// codes) are exactly MLX's "mxfp4" mode: the same codes, the exponent as the uint8 scale.
// Only the bit order of the weights changes: GGUF puts weight i of a 4/5-bit block in byte
// i % 16 (low nibble for i < 16, high for i >= 16; Q5's fifth bits in a 32-bit word); MLX packs
// consecutive weights as a little-endian bit stream (from the low bits of uint32 words).
// F32, F16 and BF16 rows are already MLX's layout (row-major, same dtype): they are copied.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>
#include <thread>

#include <nanobind/nanobind.h>

#include "records.h"

namespace nb = nanobind;

namespace moe_l2 {

namespace {

enum class Kind { F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 };

struct Format {
  const char* name;
  Kind kind;
  size_t block_elems;  // weights per block
  size_t block_bytes;  // bytes per block in the GGUF file
  int bits;            // 0 for float types
  size_t scale_bytes;  // per group: 2 (float16) for affine, 1 (e8m0) for mxfp4
  bool biases;
};

constexpr Format kFormats[] = {
    {"F32", Kind::F32, 1, 4, 0, 0, false},       {"F16", Kind::F16, 1, 2, 0, 0, false},
    {"BF16", Kind::BF16, 1, 2, 0, 0, false},     {"Q4_0", Kind::Q4_0, 32, 18, 4, 2, true},
    {"Q4_1", Kind::Q4_1, 32, 20, 4, 2, true},    {"Q5_0", Kind::Q5_0, 32, 22, 5, 2, true},
    {"Q5_1", Kind::Q5_1, 32, 24, 5, 2, true},    {"Q8_0", Kind::Q8_0, 32, 34, 8, 2, true},
    {"MXFP4", Kind::MXFP4, 32, 17, 4, 1, false},
};

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> float16, round to nearest even, overflow to infinity.
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) {
    return uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u));
  }
  int e = int(exp) - 127 + 15;
  if (e >= 31) {
    return uint16_t(sign | 0x7c00u);
  }
  if (e <= 0) {
    if (e < -10) {
      return uint16_t(sign);
    }
    mant |= 0x800000u;
    int shift = 14 - e;
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) {
      ++half;
    }
    return uint16_t(sign | half);
  }
  uint32_t half = (uint32_t(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) {
    ++half;  // a carry into the exponent is the right result, up to infinity
  }
  return uint16_t(sign | half);
}

uint16_t load16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void store16(std::byte* p, uint16_t v) { std::memcpy(p, &v, 2); }

uint16_t scaled(uint16_t d, float by) { return float_to_half(half_to_float(d) * by); }

// The 16 packed bytes of a 4-bit block: weight i of the block in byte i / 2, low nibble first.
void pack_nibbles(const uint8_t* qs, uint8_t* out) {
  for (int k = 0; k < 8; ++k) {  // weights 2k, 2k+1: low nibbles of qs[2k], qs[2k+1]
    out[k] = uint8_t((qs[2 * k] & 0x0f) | ((qs[2 * k + 1] & 0x0f) << 4));
  }
  for (int k = 0; k < 8; ++k) {  // weights 16+2k, 17+2k: high nibbles
    out[8 + k] = uint8_t((qs[2 * k] >> 4) | (qs[2 * k + 1] & 0xf0));
  }
}

// 32 five-bit weights (low nibbles in qs as for 4 bits, fifth bits in qh) as a 20-byte bit stream.
void pack_five(const uint8_t* qs, uint32_t qh, uint8_t* out) {
  for (int chunk = 0; chunk < 4; ++chunk) {
    uint64_t bits = 0;
    for (int k = 0; k < 8; ++k) {
      int i = 8 * chunk + k;
      uint32_t low = i < 16 ? (qs[i] & 0x0fu) : (qs[i - 16] >> 4);
      uint32_t q = low | (((qh >> i) & 1u) << 4);
      bits |= uint64_t(q) << (5 * k);
    }
    for (int b = 0; b < 5; ++b) {
      out[5 * chunk + b] = uint8_t(bits >> (8 * b));
    }
  }
}

uint32_t load32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Job {
  const Format* format;
  size_t rows, cols;
  const std::byte* src;
  std::byte* weight;
  std::byte* scales;
  std::byte* biases;
};

void transcode_rows(const Job& job, size_t row_begin, size_t row_end) {
  const Format& f = *job.format;
  if (f.bits == 0) {
    size_t row_bytes = job.cols * f.block_bytes;
    std::memcpy(job.weight + row_begin * row_bytes, job.src + row_begin * row_bytes,
                (row_end - row_begin) * row_bytes);
    return;
  }
  size_t blocks = job.cols / 32;
  size_t src_row = blocks * f.block_bytes;
  size_t w_row = job.cols * size_t(f.bits) / 8;
  size_t s_row = blocks * f.scale_bytes;
  for (size_t r = row_begin; r < row_end; ++r) {
    const std::byte* src = job.src + r * src_row;
    auto* w = reinterpret_cast<uint8_t*>(job.weight + r * w_row);
    std::byte* s = job.scales + r * s_row;
    std::byte* b = f.biases ? job.biases + r * s_row : nullptr;
    for (size_t i = 0; i < blocks; ++i, src += f.block_bytes) {
      if (f.kind == Kind::MXFP4) {
        s[i] = src[0];
        pack_nibbles(reinterpret_cast<const uint8_t*>(src + 1), w + 16 * i);
        continue;
      }
      uint16_t d = load16(src);
      store16(s + 2 * i, d);
      switch (f.kind) {
        case Kind::Q4_0:
          store16(b + 2 * i, scaled(d, -8.0f));
          pack_nibbles(reinterpret_cast<const uint8_t*>(src + 2), w + 16 * i);
          break;
        case Kind::Q4_1:
          store16(b + 2 * i, load16(src + 2));
          pack_nibbles(reinterpret_cast<const uint8_t*>(src + 4), w + 16 * i);
          break;
        case Kind::Q5_0:
          store16(b + 2 * i, scaled(d, -16.0f));
          pack_five(reinterpret_cast<const uint8_t*>(src + 6), load32(src + 2), w + 20 * i);
          break;
        case Kind::Q5_1:
          store16(b + 2 * i, load16(src + 2));
          pack_five(reinterpret_cast<const uint8_t*>(src + 8), load32(src + 4), w + 20 * i);
          break;
        case Kind::Q8_0: {
          store16(b + 2 * i, scaled(d, -128.0f));
          const auto* qs = reinterpret_cast<const uint8_t*>(src + 2);
          for (int k = 0; k < 32; ++k) {
            w[32 * i + k] = uint8_t(qs[k] ^ 0x80u);
          }
          break;
        }
        default:
          break;
      }
    }
  }
}

}  // namespace

void transcode_gguf(const std::vector<TranscodeJob>& jobs_in, int threads) {
  const char* fn = "transcode_gguf";
  if (threads < 1) {
    throw_value_error(fn, "threads must be >= 1, got " + std::to_string(threads));
  }
  std::vector<std::shared_ptr<Region>> regions;
  std::vector<Job> jobs;
  for (size_t j = 0; j < jobs_in.size(); ++j) {
    const auto& [type, rows_in, cols_in, src, src_off_in, weight, w_off_in, scales, s_off_in, biases, b_off_in] =
        jobs_in[j];
    std::string what = "jobs[" + std::to_string(j) + "]";
    const Format* format = nullptr;
    for (const Format& f : kFormats) {
      if (type == f.name) {
        format = &f;
      }
    }
    if (format == nullptr) {
      std::string known;
      for (const Format& f : kFormats) {
        known += (known.empty() ? "" : ", ") + std::string(f.name);
      }
      throw_value_error(fn, what + ": GGUF type " + type + " is not supported (supported: " + known + ")");
    }
    size_t rows = to_size(fn, (what + " rows").c_str(), rows_in);
    size_t cols = to_size(fn, (what + " cols").c_str(), cols_in);
    if (format->bits != 0 && cols % format->block_elems != 0) {
      throw_value_error(fn, what + ": " + type + " rows hold whole blocks of 32 weights, got " +
                                std::to_string(cols) + " columns");
    }
    if (src == nullptr || weight == nullptr || (format->bits != 0 && (scales == nullptr || biases == nullptr))) {
      throw_value_error(fn, what + " lacks a source or a destination");
    }
    size_t src_bytes = checked_mul(fn, rows, checked_mul(fn, cols / format->block_elems, format->block_bytes));
    size_t w_bytes = format->bits == 0 ? src_bytes : checked_mul(fn, rows, cols * size_t(format->bits) / 8);
    size_t s_bytes = format->bits == 0 ? 0 : checked_mul(fn, rows, cols / 32 * format->scale_bytes);
    size_t src_off = to_size(fn, (what + " src_offset").c_str(), src_off_in);
    size_t w_off = to_size(fn, (what + " weight_offset").c_str(), w_off_in);
    src->check_range(fn, src_off, src_bytes);
    weight->check_range(fn, w_off, w_bytes);
    regions.push_back(src->region(fn));
    Job job{format, rows, cols, regions.back()->data + src_off, nullptr, nullptr, nullptr};
    regions.push_back(weight->region(fn, true));
    job.weight = regions.back()->data + w_off;
    if (format->bits != 0) {
      size_t s_off = to_size(fn, (what + " scales_offset").c_str(), s_off_in);
      size_t b_off = to_size(fn, (what + " biases_offset").c_str(), b_off_in);
      scales->check_range(fn, s_off, s_bytes);
      regions.push_back(scales->region(fn, true));
      job.scales = regions.back()->data + s_off;
      if (format->biases) {
        biases->check_range(fn, b_off, s_bytes);
        regions.push_back(biases->region(fn, true));
        job.biases = regions.back()->data + b_off;
      }
    }
    jobs.push_back(job);
  }

  // Work items of about 256 KiB of source each, so that one large tensor uses every thread.
  struct Item {
    size_t job, begin, end;
  };
  std::vector<Item> items;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    size_t row_bytes = std::max<size_t>(1, job.cols / job.format->block_elems * job.format->block_bytes);
    size_t step = std::max<size_t>(1, (size_t(256) << 10) / row_bytes);
    for (size_t r = 0; r < job.rows; r += step) {
      items.push_back({j, r, std::min(job.rows, r + step)});
    }
  }
  nb::gil_scoped_release unlocked;
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      transcode_rows(jobs[items[i].job], items[i].begin, items[i].end);
    }
  };
  run_on_threads(std::min(items.size(), size_t(threads)), loop);
}

}  // namespace moe_l2
