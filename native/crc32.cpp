// CRC-32: portable code (slicing, eight table lookups per 8 bytes; two CRCs combined by multiplication
// modulo the polynomial, which lets each read thread checksum its own part of a record), zlib's own where the
// build found it (CMakeLists.txt), and the CPU's where it has one, which the reads then use: carry-less
// multiplication on x86-64 (PCLMULQDQ, or VPCLMULQDQ with AVX-512, detected at run time), the CRC32 instructions
// on arm64. A record's CRC at zlib's speed here was most of what a checked miss cost beyond its read
// (docs/benchmarks.md, "Cold misses").

#include "crc32.h"

#ifdef MOE_L2_HAVE_ZLIB
#include <zlib.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_L2_CRC32_CLMUL 1
#include <immintrin.h>
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__ARM_FEATURE_CRC32) || defined(__linux__))
// Every arm64 Mac builds with the CRC32 instructions on; a Linux build for plain armv8-a asks the kernel whether
// the CPU has them (all Arm server and desktop cores do).
#define MOE_L2_CRC32_ARM 1
#if !defined(__ARM_FEATURE_CRC32)
#define MOE_L2_CRC32_ARM_AT_RUN_TIME 1
#include <sys/auxv.h>
#endif
#endif

namespace moe_l2 {

namespace {

constexpr uint32_t kPoly = 0xEDB88320u;  // reflected

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the sliced CRC reads 8 bytes as a little-endian word");

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> slice{};
  std::array<uint32_t, 32> x2n{};  // x^(2^k) mod P: x^8n is reached by squaring
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) {
        c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      }
      slice[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int k = 1; k < 8; ++k) {
        slice[k][i] = (slice[k - 1][i] >> 8) ^ slice[0][slice[k - 1][i] & 0xff];
      }
    }
    uint32_t p = 1u << 30;  // x^1 (bit 31 is x^0 in the reflected order)
    x2n[0] = p;
    for (size_t k = 1; k < x2n.size(); ++k) {
      x2n[k] = p = multiply(p, p);
    }
  }
  // a * b modulo P, both reflected.
  static uint32_t multiply(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, product = 0;
    for (;;) {
      if (a & m) {
        product ^= b;
        if ((a & (m - 1)) == 0) {
          return product;
        }
      }
      m >>= 1;
      b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

uint32_t crc32_update_portable(uint32_t crc, const std::byte* data, size_t n) {
  const auto& t = tables().slice;
  crc = ~crc;
  for (; n >= 8; n -= 8, data += 8) {
    uint64_t w;
    std::memcpy(&w, data, 8);
    w ^= crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
          t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; n > 0; --n, ++data) {
    crc = t[0][(crc ^ uint32_t(*data)) & 0xff] ^ (crc >> 8);
  }
  return ~crc;
}

namespace {

// x^(8 n) mod P, from the squares: bit k of n contributes x^(2^(k+3)). A CRC times it is the CRC moved past n
// bytes of zeros.
uint32_t shift_by_bytes(uint64_t n) {
  const Tables& t = tables();
  uint32_t shift = 1u << 31;  // x^0
  for (unsigned k = 3; n; n >>= 1, ++k) {
    if (n & 1) {
      shift = Tables::multiply(t.x2n[k & 31], shift);
    }
  }
  return shift;
}

}  // namespace

uint32_t crc32_concat_portable(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return Tables::multiply(shift_by_bytes(len_b), crc_a) ^ crc_b;
}

namespace {

#if MOE_L2_CRC32_CLMUL
// Folding (Gopal et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", Intel, 2009): four
// 128-bit lanes, each multiplied forward by 512 bits and added to the next 64 bytes, then folded into one lane,
// 128 bits at a time. The lane left is congruent to everything read so far, so its 16 bytes run through the
// table code from the register that absorbed the incoming CRC: no Barrett reduction. The constants are
// x^k mod P for the gzip polynomial, bit-reflected: k1, k2 = x^(512+32), x^(512-32); k3, k4 = x^(128+32),
// x^(128-32). n >= 64, a multiple of 16.
#define MOE_L2_CLMUL_TARGET __attribute__((target("pclmul,sse2")))

MOE_L2_CLMUL_TARGET inline __m128i load(const std::byte* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// k1 (low) and k2 (high): a lane carried forward 512 bits, by the 128-bit and the 512-bit folding alike.
MOE_L2_CLMUL_TARGET inline __m128i k1k2() {
  return _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
}

// x's low half times k's low half, plus x's high half times k's high half, plus next.
MOE_L2_CLMUL_TARGET inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// The lanes x0..x3 hold every byte before data, folded (x0 the earliest 16 of the last 64); folds in the
// 64-byte blocks from data on, then the 16-byte ones, and reduces. n is a multiple of 16.
MOE_L2_CLMUL_TARGET uint32_t clmul_finish(__m128i x0, __m128i x1, __m128i x2, __m128i x3, const std::byte* data,
                                          size_t n) {
  const __m128i k512 = k1k2();
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  for (; n >= 64; n -= 64, data += 64) {
    x0 = fold(x0, k512, load(data));
    x1 = fold(x1, k512, load(data + 16));
    x2 = fold(x2, k512, load(data + 32));
    x3 = fold(x3, k512, load(data + 48));
  }
  x0 = fold(fold(fold(x0, k3k4, x1), k3k4, x2), k3k4, x3);
  for (; n >= 16; n -= 16, data += 16) {
    x0 = fold(x0, k3k4, load(data));
  }
  alignas(16) std::byte lane[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lane), x0);
  return crc32_update_portable(0xFFFFFFFFu, lane, sizeof lane);  // the register from 0 (no inversions)
}

MOE_L2_CLMUL_TARGET uint32_t crc32_clmul(uint32_t crc, const std::byte* data, size_t n) {
  __m128i x0 = _mm_xor_si128(load(data), _mm_cvtsi32_si128(int(~crc)));
  return clmul_finish(x0, load(data + 16), load(data + 32), load(data + 48), data + 64, n - 64);
}

bool cpu_has_clmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
  return has;
}

// The same folding on 512-bit registers (VPCLMULQDQ, with AVX-512: Intel since Ice Lake, AMD since Zen 4):
// four of them, each four lanes, so 256 bytes a step, each lane carried forward 2048 bits (k = x^(2048+32),
// x^(2048-32)); then folded into one register 512 bits at a time (k1, k2), whose four lanes the 128-bit code
// takes on from there. n >= 256, a multiple of 16.
#define MOE_L2_VCLMUL_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse2")))

MOE_L2_VCLMUL_TARGET inline __m512i load512(const std::byte* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

MOE_L2_VCLMUL_TARGET inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
  return _mm512_xor_si512(_mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11)),
                          next);
}

MOE_L2_VCLMUL_TARGET uint32_t crc32_vclmul(uint32_t crc, const std::byte* data, size_t n) {
  const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430, 0x11542778a));
  const __m512i k512 = _mm512_broadcast_i32x4(k1k2());
  __m512i x0 = _mm512_xor_si512(load512(data), _mm512_inserti32x4(_mm512_setzero_si512(),
                                                                   _mm_cvtsi32_si128(int(~crc)), 0));
  __m512i x1 = load512(data + 64), x2 = load512(data + 128), x3 = load512(data + 192);
  data += 256;
  n -= 256;
  for (; n >= 256; n -= 256, data += 256) {
    x0 = fold512(x0, k2048, load512(data));
    x1 = fold512(x1, k2048, load512(data + 64));
    x2 = fold512(x2, k2048, load512(data + 128));
    x3 = fold512(x3, k2048, load512(data + 192));
  }
  x3 = fold512(fold512(fold512(x0, k512, x1), k512, x2), k512, x3);
  return clmul_finish(_mm512_extracti32x4_epi32(x3, 0), _mm512_extracti32x4_epi32(x3, 1),
                      _mm512_extracti32x4_epi32(x3, 2), _mm512_extracti32x4_epi32(x3, 3), data, n);
}

bool cpu_has_vclmul() {
  static const bool has = cpu_has_clmul() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("vpclmulqdq");
  return has;
}
#endif

#if MOE_L2_CRC32_ARM
// One CRC32X waits for the one before it (3 cycles on Apple's and Arm's cores, which start one a cycle), so
// three chains run side by side over three blocks of kArmBlock bytes, joined by moving the first two past the
// blocks after them (two multiplications a round, a few percent of it). Not run on a Mac here: tests check its
// values under qemu (tests/test_native.py). The compilers' builtins, in a function built for the instructions,
// so that a build without them (plain armv8-a) still has the code for CPUs that have them.
#if defined(__clang__)
#define MOE_L2_ARM_CRC_TARGET __attribute__((target("crc")))
#define MOE_L2_CRC32X __builtin_arm_crc32d
#define MOE_L2_CRC32B __builtin_arm_crc32b
#else
#define MOE_L2_ARM_CRC_TARGET __attribute__((target("+crc")))
#define MOE_L2_CRC32X __builtin_aarch64_crc32x
#define MOE_L2_CRC32B __builtin_aarch64_crc32b
#endif

constexpr size_t kArmBlock = size_t(16) << 10;

inline uint64_t word(const std::byte* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

MOE_L2_ARM_CRC_TARGET uint32_t crc32_arm(uint32_t crc, const std::byte* data, size_t n) {
  static const uint32_t past_block = shift_by_bytes(kArmBlock);
  for (; n >= 3 * kArmBlock; n -= 3 * kArmBlock, data += 3 * kArmBlock) {
    uint32_t a = ~crc, b = ~0u, c = ~0u;  // registers: each chain's CRC, inverted
    for (size_t i = 0; i < kArmBlock; i += 8) {
      a = MOE_L2_CRC32X(a, word(data + i));
      b = MOE_L2_CRC32X(b, word(data + kArmBlock + i));
      c = MOE_L2_CRC32X(c, word(data + 2 * kArmBlock + i));
    }
    crc = Tables::multiply(past_block, Tables::multiply(past_block, ~a) ^ ~b) ^ ~c;
  }
  crc = ~crc;
  for (; n >= 8; n -= 8, data += 8) {
    crc = MOE_L2_CRC32X(crc, word(data));
  }
  for (; n > 0; --n, ++data) {
    crc = MOE_L2_CRC32B(crc, uint8_t(*data));
  }
  return ~crc;
}

bool cpu_has_arm_crc() {
#if MOE_L2_CRC32_ARM_AT_RUN_TIME
  static const bool has = (getauxval(AT_HWCAP) & (1ul << 7)) != 0;  // HWCAP_CRC32, <asm/hwcap.h>
  return has;
#else
  return true;
#endif
}
#endif

std::atomic<bool> library_only{false};  // bench_io's comparison of the CPU's CRC with the library's
std::atomic<bool> narrow_only{false};  // the 128-bit folding even where the CPU has 512-bit (tests, benches)

uint32_t crc32_library(uint32_t crc, const std::byte* data, size_t n) {
#ifdef MOE_L2_HAVE_ZLIB
  uLong c = crc;
  for (size_t step; n > 0; n -= step, data += step) {  // zlib takes uInt lengths
    step = std::min<size_t>(n, std::numeric_limits<uInt>::max());
    c = crc32(c, reinterpret_cast<const Bytef*>(data), uInt(step));
  }
  return uint32_t(c);
#else
  return crc32_update_portable(crc, data, n);
#endif
}

}  // namespace

void crc32_use_library(bool only) {
  library_only.store(only, std::memory_order_relaxed);
}

void crc32_use_narrow(bool only) {
  narrow_only.store(only, std::memory_order_relaxed);
}

uint32_t crc32_update(uint32_t crc, const std::byte* data, size_t n) {
  if (library_only.load(std::memory_order_relaxed)) {
    return crc32_library(crc, data, n);
  }
#if MOE_L2_CRC32_CLMUL
  if (n >= 64 && cpu_has_clmul()) {
    size_t folded = n & ~size_t(15);
    bool wide = folded >= 256 && cpu_has_vclmul() && !narrow_only.load(std::memory_order_relaxed);
    crc = wide ? crc32_vclmul(crc, data, folded) : crc32_clmul(crc, data, folded);
    data += folded;
    n -= folded;
  }
#elif MOE_L2_CRC32_ARM
  if (cpu_has_arm_crc()) {
    return crc32_arm(crc, data, n);
  }
#endif
  return crc32_library(crc, data, n);
}

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
#ifdef MOE_L2_HAVE_ZLIB
  return uint32_t(::crc32_combine64(crc_a, crc_b, z_off64_t(len_b)));
#else
  return crc32_concat_portable(crc_a, crc_b, len_b);
#endif
}

const char* crc32_kind() {
#if MOE_L2_CRC32_CLMUL
  if (cpu_has_vclmul()) {
    return "vpclmulqdq";
  }
  if (cpu_has_clmul()) {
    return "pclmul";
  }
#elif MOE_L2_CRC32_ARM
  if (cpu_has_arm_crc()) {
    return "arm-crc32";
  }
#endif
  return crc32_from_zlib() ? "zlib" : "portable";
}

bool crc32_from_zlib() {
#ifdef MOE_L2_HAVE_ZLIB
  return true;
#else
  return false;
#endif
}

}  // namespace moe_l2
