// CRC-32 (zlib's: reflected polynomial 0xEDB88320), computed by the read threads as records land, so that
// checking a record against its manifest overlaps the reads of the rest (docs/formats.md, "Checksums").
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_l2 {

// zlib.crc32(data, crc): the CRC of the bytes that `crc` covered followed by [data, data + n).
uint32_t crc32_update(uint32_t crc, const std::byte* data, size_t n);

// The CRC of A followed by B, from crc(A), crc(B) and B's length (zlib's crc32_combine).
uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// The portable code, which builds without zlib use: the reads go through the two above.
uint32_t crc32_update_portable(uint32_t crc, const std::byte* data, size_t n);
uint32_t crc32_concat_portable(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Whether the two above are zlib's.
bool crc32_from_zlib();

// What crc32_update runs on here: "vpclmulqdq" (512-bit, for 256 bytes and more; "pclmul" below that),
// "pclmul", "arm-crc32", "zlib" or "portable".
const char* crc32_kind();

// Bench hook: crc32_update runs zlib's (or the portable) code even where the CPU has its own.
void crc32_use_library(bool only);

// Test and bench hook: crc32_update folds 128 bits at a time even where the CPU folds 512 ("vpclmulqdq").
void crc32_use_narrow(bool only);

}  // namespace moe_l2
