// Python bindings of moe_l2._native. Compiled with NB_DOMAIN mlx, so mlx::core::array and
// mlx::core::Dtype cross the boundary as mlx.core.array and mlx.core.Dtype.
#include <algorithm>
#include <cstring>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "crc32.h"
#include "learned.h"
#include "memory.h"
#include "read_units.h"
#include "records.h"
#include "slot_index.h"
#include "word_wait.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moe_l2 {

namespace {

// OSError(err, "") is how Python picks the errno's subclass (FileExistsError, ...); the
// raised one carries our message alone, so that str() starts with "[function] ".
void set_os_error(const OsError& e) {
  nb::object cls = nb::borrow(PyExc_OSError);
  if (e.err != 0) {
    cls = nb::borrow(cls(e.err, "").type());
  }
  nb::object exc = cls(e.what());
  if (e.err != 0) {
    exc.attr("errno") = e.err;
  }
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

// Buffer protocol of every Memory: memoryview(m), bytes(m), numpy.frombuffer(m) all work.
// Each export holds the region, so the bytes outlive Segment.close() while a view exists.
int memory_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  view->obj = nullptr;
  try {
    const Memory* mem = nb::inst_ptr<Memory>(self);
    auto region = mem->region("Memory.view", (flags & PyBUF_WRITABLE) != 0);
    if (PyBuffer_FillInfo(view, self, region->data, static_cast<Py_ssize_t>(region->nbytes),
                          mem->readonly(), flags) != 0) {
      return -1;
    }
    view->internal = new std::shared_ptr<Region>(std::move(region));
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
    return -1;
  }
}

void memory_releasebuffer(PyObject*, Py_buffer* view) {
  delete static_cast<std::shared_ptr<Region>*>(view->internal);
}

PyType_Slot memory_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(memory_getbuffer)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(memory_releasebuffer)},
    {0, nullptr}};

size_t offset_arg(const char* fn, int64_t off) { return to_size(fn, "offset", off); }

// Bytes [0, nbytes) of src at src_offset copied to dst at dst_offset, a MiB at a time, each chunk's part of
// the pieces (offset, nbytes: ascending, disjoint, inside the range) checksummed right after it lands, while
// it is in cache: the CRC-32 of the pieces in order, as pread_scatter computes a record's as it reads. With no
// pieces (a manifest checks the slot) the copy stores past the cache and returns 0.
uint32_t copy_record(const Memory& src, int64_t src_offset, Memory& dst, int64_t dst_offset, int64_t nbytes_in,
                     const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  const char* fn = "copy_record";
  constexpr size_t kChunk = size_t(1) << 20;
  size_t from = to_size(fn, "src_offset", src_offset), to = to_size(fn, "dst_offset", dst_offset);
  size_t nbytes = to_size(fn, "nbytes", nbytes_in);
  src.check_range(fn, from, nbytes);
  dst.check_range(fn, to, nbytes);
  size_t end = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    size_t off = to_size(fn, "piece offset", pieces[i].first), len = to_size(fn, "piece nbytes", pieces[i].second);
    if (off < end || checked_add(fn, off, len) > nbytes) {
      throw_value_error(fn, "pieces[" + std::to_string(i) + "] is not after the one before it inside the " +
                                std::to_string(nbytes) + " bytes copied");
    }
    end = off + len;
  }
  auto src_region = src.region(fn);
  auto dst_region = dst.region(fn, true);
  const std::byte* s = src_region->data + from;
  std::byte* d = dst_region->data + to;
  uint32_t crc = 0;
  {
    nb::gil_scoped_release unlocked;
    if (pieces.empty()) {
      copy_past_cache(d, s, nbytes);  // nothing to checksum: no reason to keep the bytes in cache
      return 0;
    }
    size_t piece = 0;
    for (size_t lo = 0; lo < nbytes; lo += kChunk) {
      size_t hi = std::min(nbytes, lo + kChunk);
      std::memcpy(d + lo, s + lo, hi - lo);
      for (; piece < pieces.size(); ++piece) {
        size_t p_lo = size_t(pieces[piece].first), p_hi = p_lo + size_t(pieces[piece].second);
        size_t a = std::max(p_lo, lo), b = std::min(p_hi, hi);
        if (a < b) {
          crc = crc32_update(crc, d + a, b - a);
        }
        if (p_hi > hi) {
          break;  // the rest of this piece lands with the next chunk
        }
      }
    }
  }
  return crc;
}

}  // namespace

void init_memory(nb::module_& m) {
  nb::class_<Memory>(m, "Memory", nb::type_slots(memory_slots),
                     "A byte range the module copies into and out of (abstract: see Buffer, "
                     "Segment). Supports the buffer protocol.")
      .def_prop_ro("nbytes", &Memory::nbytes)
      .def_prop_ro("address", [](const Memory& self) { return self.address("Memory.address"); })
      .def_prop_ro("readonly", &Memory::readonly)
      .def(
          "view",
          [](nb::handle self) {
            PyObject* view = PyMemoryView_FromObject(self.ptr());
            if (view == nullptr) {
              throw nb::python_error();
            }
            return nb::steal(view);
          },
          "A memoryview of all the bytes (read-only if the memory is); it keeps them alive.")
      .def(
          "load_u32",
          [](const Memory& self, int64_t off) { return self.load_u32(offset_arg("Memory.load_u32", off)); },
          "offset"_a, "Atomic acquire load of the uint32 at offset.")
      .def(
          "load_i32",
          [](const Memory& self, int64_t off) { return self.load_i32(offset_arg("Memory.load_i32", off)); },
          "offset"_a, "Atomic acquire load of the int32 at offset.")
      .def(
          "store_u32",
          [](Memory& self, int64_t off, uint32_t v) { self.store_u32(offset_arg("Memory.store_u32", off), v); },
          "offset"_a, "value"_a, "Atomic release store of a uint32 at offset.")
      .def(
          "store_i32",
          [](Memory& self, int64_t off, int32_t v) { self.store_i32(offset_arg("Memory.store_i32", off), v); },
          "offset"_a, "value"_a, "Atomic release store of an int32 at offset.");

  nb::class_<Buffer, Memory>(m, "Buffer",
                             "C++-owned memory from MLX's allocator: page-aligned, zero-filled, "
                             "at a stable address, and the backing store of zero-copy arrays.")
      .def(nb::init<int64_t>(), "nbytes"_a)
      .def("array", &Buffer::array, "offset"_a, "shape"_a, "dtype"_a, "strides"_a = std::vector<int64_t>{},
           "A zero-copy mlx.core.array: element [i, j, ...] at offset + (i * strides[0] + ...) * "
           "itemsize bytes (strides in items; row-major where none are given); the array keeps the "
           "memory alive.")
      .def("__repr__", [](const Buffer& self) {
        return "<moe_l2._native.Buffer nbytes=" + std::to_string(self.nbytes()) + ">";
      });

  nb::class_<HostBuffer, Memory>(m, "HostBuffer",
                                 "Plain host memory (anonymous pages), page-aligned and zero-filled, "
                                 "outside MLX's allocator: scratch that starts no GPU device.")
      .def(nb::init<int64_t>(), "nbytes"_a)
      .def("__repr__", [](const HostBuffer& self) {
        return "<moe_l2._native.HostBuffer nbytes=" + std::to_string(self.nbytes()) + ">";
      });
}

void init_segment(nb::module_& m) {
  nb::class_<Segment, Memory>(m, "Segment", "A mapped POSIX shared-memory object.")
      .def_static("create", &Segment::create, "name"_a, "nbytes"_a, "mode"_a = 0600,
                  nb::call_guard<nb::gil_scoped_release>(),
                  "Create (O_EXCL) and map read-write a segment of nbytes, reserving its pages, "
                  "then lock them in memory (mlock) or, where that is not permitted, touch every "
                  "page; see locked and lock_error. Releases the GIL.")
      .def_static("open", &Segment::open, "name"_a, "readonly"_a = true, "min_size"_a = 0,
                  nb::call_guard<nb::gil_scoped_release>(),
                  "Map an existing segment; its size comes from the object. Never blocks on what "
                  "holds the name (O_NONBLOCK | O_NOFOLLOW on Linux); ValueError for anything but "
                  "a segment (a FIFO, a directory) and for one smaller than min_size bytes. "
                  "Releases the GIL.")
      .def_static("unlink", &Segment::unlink, "name"_a, "owner"_a = -1,
                  nb::call_guard<nb::gil_scoped_release>(),
                  "Remove a segment's name; False if there was none. Mappings stay valid. With "
                  "owner (a uid), only a segment fstat says that uid owns, opened without blocking; "
                  "PermissionError for another's, and for anything that is not a segment. Releases "
                  "the GIL.")
      .def("array", &Segment::array, "offset"_a, "shape"_a, "strides"_a, "dtype"_a,
           "A zero-copy MLX view: element [i, j, ...] at offset + (i * strides[0] + ...) * itemsize "
           "bytes; it keeps the mapping alive.")
      .def_prop_ro("name", &Segment::name)
      .def_prop_ro("locked", &Segment::locked,
                   "Whether create() locked the pages in memory (False for opened segments).")
      .def_prop_ro("lock_error", &Segment::lock_error,
                   "Why create() could not lock the pages; empty when it did or for opened segments.")
      .def_prop_ro("owner_uid", &Segment::owner_uid,
                   "Owner of the object, from fstat on the mapped descriptor.")
      .def_prop_ro("mode", &Segment::mode,
                   "Permission bits of the object, from fstat on the mapped descriptor.")
      .def_prop_ro("closed", &Segment::closed)
      .def("release", &Segment::release, "offset"_a, "nbytes"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Give a page-aligned range's pages back to the system (Linux: munlock + MADV_REMOVE; "
           "the range reads as zeros until written). False where the platform cannot (macOS).")
      .def("restore", &Segment::restore, "offset"_a, "nbytes"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Take a released range back into use: reserve its pages again (Linux: posix_fallocate; OSError, "
           "e.g. ENOSPC where /dev/shm is full, leaves it unusable), then lock them if the segment was locked.")
      .def("prefault", &Segment::prefault, "offset"_a, "nbytes"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Map a page-aligned range's pages for writing now, changing no byte (Linux: MADV_POPULATE_WRITE), "
           "so that a later copy into them takes no page fault.")
      .def("close", &Segment::close,
           "Drop this object's mapping (idempotent); the memory is unmapped once no view uses it.")
      .def("__repr__", [](const Segment& self) {
        return "<moe_l2._native.Segment " + self.name() + " nbytes=" +
               std::to_string(self.nbytes()) + (self.readonly() ? " readonly" : "") +
               (self.closed() ? " closed" : "") + ">";
      });
}

void init_slot_index(nb::module_& m) {
  nb::class_<SlotIndex> cls(m, "SlotIndex",
                            "One MoE layer's slots in the daemon's shared memory: its part of the index "
                            "segment (slot_of and the slots' metadata) and its data segment, with the "
                            "seqlock's writer and reader sides as named operations (docs/architecture.md, "
                            "\"Shared memory\"). Keeps index and data alive.");
  cls.def(nb::init<Memory&, Memory*, int64_t, int64_t, int64_t, int64_t, int64_t>(), "index"_a,
          "data"_a.none(), nb::kw_only(), "slot_of_offset"_a, "meta_offset"_a, "n_experts"_a,
          "n_slots"_a, "slot_stride"_a, nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(),
          "The layer's slot_of at slot_of_offset and metadata at meta_offset of index, its records "
          "slot_stride apart in data (None: an unserved layer, which has none); bounds-checked here.")
      .def("begin_fill", &SlotIndex::begin_fill, "slot"_a, "evicted"_a = -1, "incoming"_a = -1,
           "Writer: start filling slot (seq odd; RuntimeError if it already is), unmap the evicted "
           "expert (-1: none), mark the slot empty, and say that the incoming expert's record is coming "
           "into it (-1: none), waking its waiters. Returns the new seq.")
      .def("finish_fill", &SlotIndex::finish_fill, "slot"_a, "expert"_a, "checksum"_a = 0,
           "Writer: the slot now holds expert's whole record: set its checksum and expert, make seq "
           "even, then map expert to the slot. Returns the new seq.")
      .def("abort_fill", &SlotIndex::abort_fill, "slot"_a, "incoming"_a = -1,
           "Writer: end a fill that wrote no record (seq even, the slot left empty); the incoming expert "
           "begin_fill named is absent again, its waiters woken. Returns the new seq.")
      .def("clear", &SlotIndex::clear, "Writer: every expert absent, every slot empty (a new index).")
      .def("copy", &SlotIndex::copy, "pieces"_a, "experts"_a, "rows"_a, "threads"_a = 1,
           "Copy the records of experts into rows of the pieces' destinations ((src_off, nbytes, dst, "
           "stride) each: row r at r * stride bytes of dst), checked by each slot's seqlock, on up to "
           "`threads` threads, with the GIL released. Result i is False where experts[i] is absent or was being filled (its rows may then be "
           "partly written).")
      .def("lend", &SlotIndex::lend, "experts"_a,
           "(slot, seq) of each expert held whole now, slot -1 for the rest: records to compute on in "
           "place; check() says afterwards whether they stayed whole.")
      .def("check", &SlotIndex::check, "slots"_a, "seqs"_a,
           "Once whatever read the lent records has finished: whether each slot still has the seq it "
           "was lent with (True: the bytes read were one whole record).")
      .def("wait", &SlotIndex::wait, "experts"_a, "timeout_s"_a, "absent"_a = false,
           "Sleep, with the GIL released, while each expert's record is coming into a slot (absent: also "
           "while it is absent and no fill of it has begun), until it is published, its fill ends without "
           "it, or timeout_s in all has passed; only a wake-up, never a promise: copy or lend it afterwards. "
           "Result i: whether experts[i] was coming (or, absent, awaited).")
      .def("slot_of", &SlotIndex::slot_of, "expert"_a,
           "The slot that slot_of maps expert to (-1: none; -(s + 2): its record is coming into slot s).")
      .def("meta", &SlotIndex::meta, "slot"_a, "The slot's (expert, seq, checksum).")
      .def_prop_ro("n_experts", &SlotIndex::n_experts)
      .def_prop_ro("n_slots", &SlotIndex::n_slots)
      .def("__repr__", [](const SlotIndex& self) {
        return "<moe_l2._native.SlotIndex n_experts=" + std::to_string(self.n_experts()) +
               " n_slots=" + std::to_string(self.n_slots()) + ">";
      });
  // The sizes src/moe_l2/layout.py lays each layer's part of the index out with.
  cls.attr("SLOT_OF_BYTES") = kSlotOfBytes;
  cls.attr("META_BYTES") = sizeof(SlotMeta);
  // What SlotIndex.wait sleeps with here: "futex", "os_sync", "ulock" or "poll" (native/word_wait.h).
  cls.attr("WAIT_KIND") = word_wait_kind();
}

void init_pread(nb::module_& m) {
  m.def("pread_records", &pread_records, "jobs"_a, "threads"_a = 4, "unit_bytes"_a = kReadUnitBytes,
        "Read each job (fd, file_offset, nbytes, dst, dst_offset) into dst, in reads of at most "
        "`unit_bytes`, on up to `threads` threads, with the GIL released. Direct-I/O fds (see "
        "set_direct) read whole aligned blocks, through a bounce buffer where the job is unaligned.");
  m.def("pread_scatter", &pread_scatter, "jobs"_a, "threads"_a = 4, "unit_bytes"_a = kReadUnitBytes,
        "checksums"_a = false, "landed"_a = nb::none(),
        "landed_at"_a = std::vector<int64_t>{}, "landed_fd"_a = -1,
        "For each job (fd, file_offset, nbytes, pieces): the extent read in reads of at most "
        "`unit_bytes`, one preadv each, straight into the pieces (src_offset, nbytes, dst, dst_offset) "
        "as far as a direct read can fill them (wholly, on a buffered fd; pieces that lie in one dst as "
        "they lie in the file as one range, the bytes between them written there too), the rest into "
        "aligned scratch memory and copied out as it lands; on up to `threads` threads, with the GIL "
        "released. With `checksums`, returns each job's CRC-32 over its pieces in order (as zlib.crc32 chained over "
        "them), computed as the bytes land; else []. With `landed` (a Buffer of 4-byte words), as all of job j's "
        "bytes are in its pieces, word landed_at[j] becomes 1 and landed_fd gets one byte (not for the last job "
        "to land: the call returns then).");
  m.def("wake_when_reading", &wake_when_reading, "fds"_a,
        "Have this thread's next pread_records or pread_scatter write one byte to each fd once it has released "
        "the GIL to read: the threads those fds wake then run beside the reads instead of delaying their start. "
        "The fds must be non-blocking (a full one already holds a wake-up). Replaces what was set before.");
  m.def("flush_read_wakes", &flush_read_wakes,
        "Write what wake_when_reading set and no read has written yet (a fetch that ends up reading nothing), and "
        "clear it; the GIL kept, as wake's.");
  m.def("wake", &write_wake, "fd"_a,
        "Write one byte to a non-blocking fd (a full one holds a wake-up already), the GIL kept: the thread it wakes "
        "runs once this one lets the GIL go, not in the middle of what this one does next.");
  m.def("set_direct", &set_direct, "fd"_a, "enable"_a = true,
        "Direct I/O for fd: O_DIRECT on Linux, F_NOCACHE on macOS. Returns whether reads now "
        "bypass the page cache (False where the filesystem or platform has none).");
  m.def("direct_fallbacks", &direct_fallbacks,
        "How many fds went back to buffered reads because the filesystem refused a direct read.");
  m.def("_fail_direct_reads", &fail_direct_reads, "n"_a,
        "Test hook: the next n direct preads fail with EINVAL.");
  m.def("_scatter_straight", &scatter_straight, "enable"_a,
        "Bench hook: False makes pread_scatter copy every piece out of its scratch (the path before "
        "aligned pieces were read straight into their rows); True, the default, again.");
  m.def("_prefault_by_touch", &prefault_by_touch, "enable"_a,
        "Test hook: True makes Segment.prefault touch every page, as on macOS; False, the default, again.");
  m.def("page_cache_bytes", &page_cache_bytes, "fd"_a, "offset"_a = 0, "nbytes"_a = -1,
        "Bytes of the file's range [offset, offset + nbytes) resident in the page cache (mincore); "
        "nbytes < 0: to the end of the file.");
  m.attr("DIRECT_ALIGN") = kDirectAlign;
}

void init_crc32(nb::module_& m) {
  m.def(
      "crc32",
      [](nb::handle data, uint32_t crc, bool portable) {
        const char* fn = "crc32";
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
          PyErr_Clear();
          throw_value_error(fn, "takes a contiguous bytes-like object (bytes, a memoryview of a Buffer, ...)");
        }
        uint32_t out;
        {
          nb::gil_scoped_release unlocked;
          out = (portable ? crc32_update_portable : crc32_update)(crc, static_cast<const std::byte*>(view.buf),
                                                                  size_t(view.len));
        }
        PyBuffer_Release(&view);
        return out;
      },
      "data"_a, "crc"_a = 0, "portable"_a = false,
      "zlib.crc32(data, crc) of any contiguous bytes-like object, as the reads compute it (the CPU's CRC where "
      "it has one; portable: the code builds without zlib use); the GIL released.");
  m.def(
      "crc32_concat",
      [](uint32_t crc_a, uint32_t crc_b, uint64_t len_b, bool portable) {
        return (portable ? crc32_concat_portable : crc32_concat)(crc_a, crc_b, len_b);
      },
      "crc_a"_a, "crc_b"_a, "len_b"_a, "portable"_a = false,
      "The CRC-32 of A followed by B from crc32(A), crc32(B) and B's length (zlib's crc32_combine).");
  m.def("copy_record", &copy_record, "src"_a, "src_offset"_a, "dst"_a, "dst_offset"_a, "nbytes"_a, "pieces"_a,
        "Copy bytes [0, nbytes) at src_offset of src to dst_offset of dst and return the CRC-32 of the pieces "
        "((offset, nbytes) in the range, ascending), computed as the bytes land; the GIL released.");
  m.attr("CRC32_FROM_ZLIB") = crc32_from_zlib();
  m.attr("CRC32_KIND") = crc32_kind();
  m.def("_crc32_use_library", &crc32_use_library, "only"_a,
        "Bench hook: the reads' CRC runs zlib's (or the portable) code even where the CPU has its own (True), or "
        "the CPU's again (False).");
  m.def("_crc32_use_narrow", &crc32_use_narrow, "only"_a,
        "Test and bench hook: the CPU's CRC folds 128 bits at a time even where it can fold 512 (True), or "
        "as wide as it can again (False).");
}

namespace {
// The learned model's arrays as numpy views of its own memory, which the model (their owner) outlives.
using View = nb::ndarray<nb::numpy, float>;

View view(nb::handle owner, std::vector<float>& data, std::initializer_list<size_t> shape) {
  return View(data.data(), shape.size(), shape.begin(), owner);
}

nb::tuple observe(LearnedModel& model, const std::vector<int64_t>& picked, int64_t source,
                  const std::vector<int64_t>& context, size_t capacity) {
  std::vector<float> score;
  std::vector<int64_t> gone;
  {
    nb::gil_scoped_release unlocked;
    model.observe(picked, source, context, capacity, score, gone);
  }
  return nb::make_tuple(score, gone);
}

}  // namespace

void init_learned(nb::module_& m) {
  nb::class_<LearnedModel>(m, "LearnedModel",
                           "The learned policy's model of one layer (native/learned.h): its weights, counts, clients "
                           "and pending batches.")
      .def("__init__",
           [](LearnedModel* self, size_t n_experts, std::vector<float> count_decay,
              std::vector<double> horizon_multiples, std::pair<int64_t, int64_t> lifetime, float rate,
              double rms_decay, float eps, float history_decay, float history_floor, size_t max_sources,
              int64_t source_ttl) {
             if (n_experts < 1 || horizon_multiples.empty() || lifetime.first < 1 || lifetime.second < lifetime.first ||
                 max_sources < 1 || source_ttl < 1) {
               throw std::invalid_argument("LearnedModel: experts, horizons, the lifetime's range, the sources "
                                           "and their time to live must be positive");
             }
             new (self) LearnedModel(n_experts, {std::move(count_decay), std::move(horizon_multiples),
                                                 lifetime.first, lifetime.second, rate, rms_decay, eps,
                                                 history_decay, history_floor, max_sources, source_ttl});
           },
           "n_experts"_a, "count_decay"_a, "horizon_multiples"_a, "lifetime"_a, "rate"_a, "rms_decay"_a, "eps"_a,
           "history_decay"_a, "history_floor"_a, "max_sources"_a, "source_ttl"_a)
      .def("observe", &observe, "picked"_a, "source"_a, "context"_a, "capacity"_a,
           "One batch (distinct experts, ascending) of client `source` (an int), with its latest picks at the layer "
           "before (the same; empty: none), the cache `capacity` slots: learn from the batches due and score every "
           "expert. Returns (each expert's score as a list, the clients let go); the GIL released.")
      .def("lifetime", &LearnedModel::lifetime, "capacity"_a)
      .def("latest",
           [](const LearnedModel& model, int64_t source) -> std::optional<std::vector<int64_t>> {
             std::vector<int64_t> batch;
             return model.latest(source, batch) ? std::optional(batch) : std::nullopt;
           },
           "source"_a)
      .def("chances",
           [](const LearnedModel& model, int64_t source) -> std::optional<std::vector<float>> {
             std::vector<float> out;
             return model.chances(source, out) ? std::optional(out) : std::nullopt;
           },
           "source"_a, "The client's latest chances, horizon by horizon, flat; None where it has none.")
      .def_rw("clock", &LearnedModel::clock)
      .def_rw("batch_mean", &LearnedModel::batch_mean)
      .def_prop_ro("dynamic_bytes", &LearnedModel::dynamic_bytes)
      .def_prop_ro("pending_sizes", &LearnedModel::pending_sizes)
      .def_prop_ro("sources", &LearnedModel::sources)
      .def("arrays",
           [](nb::handle self) {
             LearnedModel& model = nb::cast<LearnedModel&>(self);
             const size_t k = model.horizons(), n = model.n(), f = model.n_features();
             nb::dict out;
             for (auto [name, data] : {std::pair{"own", &model.own}, {"own_ms", &model.own_ms}}) {
               out[name] = view(self, *data, {k, f, n});
             }
             for (auto [name, data] : {std::pair{"cross", &model.cross}, {"cross_ms", &model.cross_ms},
                                       {"history", &model.history}, {"history_ms", &model.history_ms},
                                       {"before", &model.before}, {"before_ms", &model.before_ms}}) {
               out[name] = view(self, *data, {k, n, n});
             }
             out["counts"] = view(self, model.counts, {model.n_counts(), n});
             return out;
           },
           "Its arrays by name, numpy views of its memory, written in place by observe and by a restore.");
}

void init_transcode(nb::module_& m) {
  m.def("transcode_gguf", &transcode_gguf, "jobs"_a, "threads"_a = 1,
        "Convert GGUF tensors to MLX's layout: each job is (type, rows, cols, src, src_offset, "
        "weight, weight_offset, scales, scales_offset, biases, biases_offset). F32/F16/BF16 are "
        "copied to weight; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 become MLX affine quantization, group size 32 "
        "(scales and biases float16), as mx.load gives them; MXFP4 becomes MLX's mxfp4 mode (uint8 "
        "scales, no biases). The GIL is released.");
}

}  // namespace moe_l2

NB_MODULE(_native, m) {
  m.doc() = "moe-l2's native core: MLX-backed buffers, shared memory, the L2 slot index, record reads.";
  // Registers mlx.core.array and mlx.core.Dtype in the shared "mlx" domain before any use.
  nb::module_::import_("mlx.core");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const moe_l2::OsError& e) {
      moe_l2::set_os_error(e);
    }
  });
  moe_l2::init_memory(m);
  moe_l2::init_segment(m);  // after Memory, its base
  moe_l2::init_slot_index(m);
  moe_l2::init_pread(m);
  moe_l2::init_crc32(m);
  moe_l2::init_transcode(m);
  moe_l2::init_learned(m);
}
