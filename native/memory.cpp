// Memory, Buffer (MLX's allocator) and the MLX views of Buffer and Segment (the rest of Segment, and HostBuffer:
// segment.cpp), with the module's error and size helpers.
#include "memory.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <mlx/allocator.h>
#include <mlx/backend/cuda/cuda.h>
#include <mlx/backend/metal/metal.h>

namespace mx = mlx::core;

namespace moe_l2 {

std::string prefixed(const char* fn, const std::string& msg) {
  return std::string("[") + fn + "] " + msg;
}

void throw_value_error(const char* fn, const std::string& msg) {
  throw std::invalid_argument(prefixed(fn, msg));
}

size_t huge_page_bytes() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  return size_t(2) << 20;
#else
  return 0;
#endif
}

void copy_past_cache(std::byte* dst, const std::byte* src, size_t nbytes) {
#if defined(__x86_64__)
  size_t head = std::min(nbytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);  // streaming stores: 16-aligned
  std::memcpy(dst, src, head);
  size_t at = head;
  for (; at + 64 <= nbytes; at += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at + 48), d);
  }
  _mm_sfence();  // ordered before whatever the caller publishes next
  std::memcpy(dst + at, src + at, nbytes - at);
#else
  std::memcpy(dst, src, nbytes);
#endif
}

void fresh_huge_pages(void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = huge_page_bytes();
  uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + huge - 1) & ~(huge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(huge - 1);
  if (hi > lo) {
    // Memory the allocator hands out again may already have small pages, which the hint alone leaves
    // as they are: drop them first (the caller owns these bytes and has no use for what they held).
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: refused, the pages stay small
  }
#else
  (void)data;
  (void)nbytes;
#endif
}

size_t checked_add(const char* fn, size_t a, size_t b) {
  size_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    throw_value_error(fn, "size overflow (" + std::to_string(a) + " + " + std::to_string(b) + ")");
  }
  return r;
}

size_t checked_mul(const char* fn, size_t a, size_t b) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw_value_error(fn, "size overflow (" + std::to_string(a) + " * " + std::to_string(b) + ")");
  }
  return r;
}

size_t to_size(const char* fn, const char* what, int64_t v) {
  if (v < 0) {
    throw_value_error(fn, std::string(what) + " must be >= 0, got " + std::to_string(v));
  }
  return static_cast<size_t>(v);
}

// ---------------------------------------------------------------------------------------
// Memory

std::shared_ptr<Region> Memory::region(const char* fn, bool writable) const {
  if (!region_) {
    throw_value_error(fn, describe() + " is closed");
  }
  if (writable && readonly_) {
    throw_value_error(fn, describe() + " is read-only");
  }
  return region_;
}

uintptr_t Memory::address(const char* fn) const {
  return reinterpret_cast<uintptr_t>(region(fn)->data);
}

void Memory::check_range(const char* fn, size_t offset, size_t nbytes) const {
  if (offset > nbytes_ || nbytes > nbytes_ - offset) {
    throw_value_error(fn, "bytes [" + std::to_string(offset) + ", " +
                              std::to_string(offset + nbytes) + ") are outside " + describe() +
                              " of " + std::to_string(nbytes_) + " bytes");
  }
}

uint32_t* Memory::word(const char* fn, size_t off, bool writable) const {
  std::byte* base = region(fn, writable)->data;
  if (off % alignof(uint32_t) != 0) {
    throw_value_error(fn, "offset " + std::to_string(off) + " is not 4-byte aligned");
  }
  check_range(fn, off, sizeof(uint32_t));
  return reinterpret_cast<uint32_t*>(base + off);
}

uint32_t Memory::load_u32(size_t off) const {
  return __atomic_load_n(word("Memory.load_u32", off, false), __ATOMIC_ACQUIRE);
}

int32_t Memory::load_i32(size_t off) const {
  return static_cast<int32_t>(
      __atomic_load_n(word("Memory.load_i32", off, false), __ATOMIC_ACQUIRE));
}

void Memory::store_u32(size_t off, uint32_t v) {
  __atomic_store_n(word("Memory.store_u32", off, true), v, __ATOMIC_RELEASE);
}

void Memory::store_i32(size_t off, int32_t v) {
  __atomic_store_n(word("Memory.store_i32", off, true), static_cast<uint32_t>(v),
                   __ATOMIC_RELEASE);
}

// ---------------------------------------------------------------------------------------
// Buffer
//
// mlx::core::array(void*, shape, dtype, deleter) only wraps foreign memory where the backend
// allocator can (Metal); the CPU and CUDA allocators make it copy, so writes to the original
// memory would go unseen. Instead MLX allocates, and every array is a view sharing that
// allocation (copy_shared_buffer), which keeps it alive as long as any view exists.

namespace {

struct MlxRegion : Region {
  explicit MlxRegion(mx::array anchor) : anchor(std::move(anchor)) {}
  mx::array anchor;  // uint8 view whose first byte is `data`
};

// A byte offset where an array of itemsize-byte items may start.
size_t item_offset(const char* fn, int64_t offset_in, size_t itemsize) {
  size_t offset = to_size(fn, "offset", offset_in);
  if (offset % itemsize != 0) {
    throw_value_error(fn, "offset " + std::to_string(offset) + " is not a multiple of the " +
                              std::to_string(itemsize) + "-byte item size");
  }
  return offset;
}

// An array that owns nothing yet: copy_shared_buffer then points it into another's memory.
mx::array unbacked(mx::Shape shape, mx::Dtype dtype) {
  return mx::array(mx::allocator::Data(mx::allocator::Buffer(nullptr), [](mx::allocator::Buffer) {}),
                   std::move(shape), dtype);
}

// A view's shape and strides (in items; row-major where `strides_in` is empty), checked: the items it
// spans from its first (0 when empty) and the flags MLX gives an array laid out so.
struct ViewShape {
  mx::Shape shape;
  mx::Strides strides;
  size_t span = 0;
  mx::array::Flags flags{};
};

ViewShape view_shape(const char* fn, const std::vector<int64_t>& shape_in, const std::vector<int64_t>& strides_in) {
  if (!strides_in.empty() && strides_in.size() != shape_in.size()) {
    throw_value_error(fn, "shape and strides must be of one length");
  }
  size_t n = shape_in.size();
  std::vector<size_t> strides(n);
  size_t count = 1;  // items, and the stride a row-major layout would have at each dimension
  size_t last = 0;   // the largest item index the view reaches
  int64_t max_dim = 0;
  bool row_major = true;
  for (size_t k = n; k-- > 0;) {
    int64_t d = shape_in[k];
    if (d < 0 || d > std::numeric_limits<mx::ShapeElem>::max()) {
      throw_value_error(fn, "shape dimension " + std::to_string(d) + " is out of range");
    }
    strides[k] = strides_in.empty() ? count : to_size(fn, "stride", strides_in[k]);
    row_major = row_major && (d == 1 || strides[k] == count);
    if (d > 0) {
      last = checked_add(fn, last, checked_mul(fn, static_cast<size_t>(d - 1), strides[k]));
    }
    count = checked_mul(fn, count, static_cast<size_t>(d));
    max_dim = std::max(max_dim, d);
  }
  ViewShape view;
  for (size_t k = 0; k < n; ++k) {
    view.shape.push_back(static_cast<mx::ShapeElem>(shape_in[k]));
    view.strides.push_back(static_cast<int64_t>(strides[k]));
  }
  view.span = count == 0 ? 0 : checked_add(fn, last, 1);
  view.flags = {row_major, row_major, row_major && (count <= 1 || count == static_cast<size_t>(max_dim))};
  return view;
}

// Zero-filled, page-aligned bytes from MLX's allocator.
std::shared_ptr<Region> allocate(int64_t nbytes_in) {
  const char* fn = "Buffer";
  size_t nbytes = to_size(fn, "nbytes", nbytes_in);
  if (nbytes == 0) {
    throw_value_error(fn, "nbytes must be > 0");
  }
  // Over-allocate so the usable range can start on a page boundary (O_DIRECT reads, page-granular
  // Metal wrapping; the CPU allocator's own pointers are only 8-byte aligned), and where huge pages
  // serve it (fresh_huge_pages), a buffer of one or more on a huge-page boundary, so that all of it
  // gets them: the padding before it is not touched here.
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  bool huge = huge_page_bytes() != 0 && nbytes >= huge_page_bytes() && !mx::cu::is_available();
  size_t align = huge ? huge_page_bytes() : page;  // CUDA's allocator hands out managed memory: left alone
  mx::allocator::Data data = mx::allocator::malloc(checked_add(fn, nbytes, align - 1));
  auto* raw = static_cast<std::byte*>(data.buffer().raw_ptr());
  if (raw == nullptr) {
    throw std::bad_alloc();
  }
  size_t pad = (align - reinterpret_cast<uintptr_t>(raw) % align) % align;
  if (huge) {
    fresh_huge_pages(raw + pad, nbytes);
  }
  std::memset(raw + pad, 0, nbytes);

  mx::array base(std::move(data), mx::Shape{1}, mx::uint8);
  mx::array anchor = unbacked(mx::Shape{1}, mx::uint8);
  anchor.copy_shared_buffer(base, mx::Strides{1}, {true, true, true}, 1, static_cast<int64_t>(pad));
  auto region = std::make_shared<MlxRegion>(std::move(anchor));
  region->data = raw + pad;
  region->nbytes = nbytes;
  return region;
}

}  // namespace

Buffer::Buffer(int64_t nbytes) : Memory(allocate(nbytes), false) {}

mx::array Buffer::array(int64_t offset_in, const std::vector<int64_t>& shape_in, mx::Dtype dtype,
                        const std::vector<int64_t>& strides_in) const {
  const char* fn = "Buffer.array";
  size_t itemsize = mx::size_of(dtype);
  size_t offset = item_offset(fn, offset_in, itemsize);
  ViewShape view = view_shape(fn, shape_in, strides_in);
  check_range(fn, offset, checked_mul(fn, view.span, itemsize));

  auto region = std::static_pointer_cast<MlxRegion>(this->region(fn));
  mx::array array = unbacked(std::move(view.shape), dtype);
  array.copy_shared_buffer(region->anchor, view.strides, view.flags, view.span,
                           static_cast<int64_t>(offset / itemsize));
  return array;
}

// ---------------------------------------------------------------------------------------
// Segment::array, an MLX view as Buffer::array's (the rest of Segment: segment.cpp)

mx::array Segment::array(int64_t offset_in, const std::vector<int64_t>& shape_in,
                         const std::vector<int64_t>& strides_in, mx::Dtype dtype) const {
  const char* fn = "Segment.array";
  size_t itemsize = mx::size_of(dtype);
  size_t offset = item_offset(fn, offset_in, itemsize);
  if (shape_in.empty() || shape_in.size() != strides_in.size()) {
    throw_value_error(fn, "shape and strides must be non-empty and of one length");
  }
  for (int64_t d : shape_in) {
    if (d < 1) {
      throw_value_error(fn, "shape dimension " + std::to_string(d) + " is out of range");
    }
  }
  ViewShape view = view_shape(fn, shape_in, strides_in);
  check_range(fn, offset, checked_mul(fn, view.span, itemsize));

  auto mapping = region(fn);
  mx::allocator::Buffer buffer = mx::allocator::make_buffer(mapping->data, mapping->nbytes);
  int64_t base = 0;  // bytes from the buffer's start to the mapping's
  mx::allocator::Deleter release;
  if (buffer.ptr() != nullptr) {
    // Metal: a no-copy MTLBuffer over the page-aligned mapping.
    release = [mapping](mx::allocator::Buffer b) { mx::allocator::release(b); };
  } else if (!mx::metal::is_available() && !mx::cu::is_available()) {
    // CPU kernels read data() = buffer.raw_ptr() + offset and nothing else of the buffer: a small
    // allocation of MLX's own anchors the view, and the offset reaches the mapping from it. The anchor
    // is shared with no other array, so MLX never donates (writes) it or reads past it.
    buffer = mx::allocator::allocator().malloc(itemsize);
    base = reinterpret_cast<intptr_t>(mapping->data) -
           reinterpret_cast<intptr_t>(buffer.raw_ptr());
    release = [mapping](mx::allocator::Buffer b) { mx::allocator::allocator().free(b); };
  } else {
    throw std::runtime_error(prefixed(
        fn, "this MLX build cannot compute on shared memory in place (no Metal, not the CPU "
            "backend); copy the records instead"));
  }
  mx::array array = unbacked(std::move(view.shape), dtype);
  array.set_data(mx::allocator::Data(buffer, std::move(release)), view.span, std::move(view.strides), view.flags,
                 base + static_cast<int64_t>(offset));
  return array;
}

}  // namespace moe_l2
