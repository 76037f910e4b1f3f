// CRC-32: portable code (slicing, eight table lookups per 8 bytes; two CRCs combined by multiplication
// modulo the polynomial, which lets each read thread checksum its own part of a record), and zlib's own
// where the build found it (CMakeLists.txt), which the reads then use.

#include "crc32.h"

#ifdef MOE_L2_HAVE_ZLIB
#include <zlib.h>
#endif

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

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

uint32_t crc32_concat_portable(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  const Tables& t = tables();
  // x^(8 len_b) mod P, from the squares: bit k of len_b contributes x^(2^(k+3)).
  uint32_t shift = 1u << 31;  // x^0
  for (unsigned k = 3; len_b; len_b >>= 1, ++k) {
    if (len_b & 1) {
      shift = Tables::multiply(t.x2n[k & 31], shift);
    }
  }
  return Tables::multiply(shift, crc_a) ^ crc_b;
}

uint32_t crc32_update(uint32_t crc, const std::byte* data, size_t n) {
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

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
#ifdef MOE_L2_HAVE_ZLIB
  return uint32_t(::crc32_combine64(crc_a, crc_b, z_off64_t(len_b)));
#else
  return crc32_concat_portable(crc_a, crc_b, len_b);
#endif
}

bool crc32_from_zlib() {
#ifdef MOE_L2_HAVE_ZLIB
  return true;
#else
  return false;
#endif
}

}  // namespace moe_l2
