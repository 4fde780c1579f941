// _kvdepot: the pybind11 binding of libkvdepot (client/client.h) and of the
// paged-KV layout and CPU gather/scatter (gpu/kv_layout.h, gpu/gather.h).
// The friendly API is the pure-Python package around it (kvdepot/__init__.py).
//
// Buffers: every call that moves block bytes takes objects supporting the
// buffer protocol (numpy arrays, bytes, bytearray, memoryview) or CPU torch
// tensors (read through data_ptr(), numel() and element_size()), and uses
// their memory in place: nothing is copied on the Python side. They must be
// C-contiguous; buffers that are written must be writable.
//
// The GIL is released during every RPC and every gather/scatter; the Python
// objects whose memory is used are kept referenced meanwhile.
//
// Asynchronous transfers (get_into_async, put_async) return a TransferOp
// that holds those objects, and the native client, until the op is seen
// ready; an op dropped before then waits for its batch, with the GIL
// released, before letting them go (see PyTransferOp).
//
// Loads into a paged cache (load_into_cache_async, behind
// KvCacheStore.load_async) return a CacheLoad: a loader thread, which never
// takes the GIL, reads the batches into staging objects and scatters them
// into the cache layer by layer, so that layers become ready in order (see
// CacheLoadState and PyCacheLoad).
//
// Errors: absl::Status codes become Python exceptions whose message starts
// with the code's name: NOT_FOUND -> KeyError, INVALID_ARGUMENT and
// OUT_OF_RANGE -> ValueError, everything else -> RuntimeError.
#include <pthread.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "gpu/gather.h"
#include "gpu/kv_layout.h"
#include "storage/block_key.h"

namespace py = pybind11;

namespace kvdepot {
namespace {

// Raises the Python exception that matches `status` (which is not OK).
[[noreturn]] void Raise(const absl::Status& status) {
  std::string msg = absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                                 status.message());
  switch (status.code()) {
    case absl::StatusCode::kNotFound:
      throw py::key_error(msg);
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      throw py::value_error(msg);
    default:
      throw std::runtime_error(msg);
  }
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

// Forks of this process since the module was loaded, counted in each child
// (pthread_atfork): a Client, and what it started, made before a fork is
// the parent's. The child has none of its threads (UCX progress, gRPC's,
// a load's loader) and shares its sockets: a call from the child hangs,
// or breaks the parent's connection for every client in it, and tearing
// one down (closing the parent's session, joining threads the child does
// not have) crashes the child or ends the parent's session. So in a child
// they refuse every call, and go without touching anything of the
// parent's (what they hold is left as it is: the child's copy of memory).
std::atomic<uint64_t> forks{0};
// Whether a Client was made in this process, or before a fork in an
// ancestor: gRPC, without its fork support, cannot be used again in a
// child of a process that used it (a channel to the same server reuses the
// parent's inherited connection, which both then write to: the parent's
// calls fail for good; another hangs), so no Client is made there.
std::atomic<bool> clients_made{false};
std::atomic<bool> grpc_unusable{false};
void CountFork() {
  forks.fetch_add(1, std::memory_order_relaxed);
  if (clients_made.load(std::memory_order_relaxed)) {
    grpc_unusable.store(true, std::memory_order_relaxed);
  }
}
uint64_t Forks() { return forks.load(std::memory_order_relaxed); }

// What a call on an object made before a fork raises in the child.
[[noreturn]] void RaiseMadeBeforeFork(const char* what) {
  Raise(absl::FailedPreconditionError(absl::StrCat(
      "this ", what,
      " was made before this process was forked: its connections and "
      "threads are the parent's, and gRPC cannot be used in a process "
      "forked after it was (start worker processes with multiprocessing's "
      "'spawn' or 'forkserver', or fork before the first kvdepot.Client)")));
}

// A borrowed view of a Python object's memory, valid while the object lives
// (`owner` keeps it referenced; `view` holds the buffer-protocol export; for
// a torch tensor, `storage` holds what owns its memory, which t.set_() would
// otherwise free under a transfer: the tensor alone does not keep it; a
// resize_() that grows the tensor still moves the storage's bytes, which
// callers must not do to a tensor a transfer uses).
struct Memory {
  py::object owner;
  py::object storage;
  std::optional<py::buffer_info> view;
  char* data = nullptr;
  size_t size = 0;
  // Its elements' type: a torch dtype without "torch." ("bfloat16"), or a
  // buffer's struct format without its byte-order mark ("e", "B").
  std::string element;
  // Its shape in elements of `itemsize` bytes ({size} where it has none);
  // filled only when asked (GetMemory's with_shape).
  std::vector<int64_t> shape;
  size_t itemsize = 1;
};

constexpr bool kBigEndianHost = __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__;

// Whether a buffer's struct format (without its byte-order mark) is plain
// numbers or bytes: integers, bool, char, floats, complex ("Zf"), a byte
// string ("4s"). Anything else is refused (GetMemory): an array of Python
// objects (numpy dtype=object, format 'O') holds PyObject pointers, which a
// read would overwrite with block bytes (a crash once the array goes) and a
// put would send; structures ("T{...}", which may hold objects too),
// unicode and void formats are not plain numbers.
bool PlainElements(absl::string_view element) {
  while (!element.empty() && absl::ascii_isdigit(element[0])) element.remove_prefix(1);
  if (element.size() == 2 && element[0] == 'Z') element.remove_prefix(1);
  return element.size() == 1 && absl::StrContains("bBhHiIlLqQnNefdg?cs", element[0]);
}

// Raises ValueError for big-endian elements wider than a byte: element bytes
// are copied verbatim and are little-endian by contract (gpu/kv_layout.h),
// so they would be stored byte-swapped into a namespace others load.
// `order` is a struct format's byte-order character ('@', '=', '<', '>',
// '!'); `shown` says what the elements are, for the message.
void CheckByteOrder(char order, size_t itemsize, const std::string& what,
                    const std::string& shown) {
  const bool big = order == '>' || order == '!' ||
                   ((order == '@' || order == '=') && kBigEndianHost);
  if (big && itemsize > 1) {
    throw py::value_error(absl::StrCat(
        "INVALID_ARGUMENT: ", what, " holds big-endian elements (", shown,
        "); kvdepot copies element bytes verbatim and they must be "
        "little-endian: convert first (e.g. numpy's .astype('<f2'))"));
  }
}

// The message of the Python exception being raised, which this clears.
// REQUIRES: the GIL and a Python error set.
std::string TakePythonErrorText() {
  py::error_already_set error;  // fetches and clears it
  try {
    return std::string(py::str(error.value()));
  } catch (const std::exception&) {
    return "(no message)";
  }
}

// The storage of torch tensor `t` (None where it has none): untyped_storage()
// (torch >= 2.0), else storage(). REQUIRES: the GIL.
py::object TorchStorage(py::handle t) {
  for (const char* name : {"untyped_storage", "storage"}) {
    if (!py::hasattr(t, name)) continue;
    try {
      return t.attr(name)();
    } catch (const py::error_already_set&) {
      return py::none();  // e.g. a tensor without storage
    }
  }
  return py::none();
}

// Raises ValueError when a torch tensor's storage does not hold the bytes
// the tensor names: storage.resize_(0) (how FSDP frees parameters) leaves a
// tensor whose numel() is unchanged and whose data_ptr() is null, and a
// read or write of it would fault or land in freed memory. (Torch has no
// read-only tensors: a CPU tensor over read-only memory, e.g. from
// torch.frombuffer of bytes, is taken as writable. Nor does holding the
// storage stop a later resize_() from moving its bytes: callers must not
// resize a tensor a transfer uses.) REQUIRES: the GIL.
void CheckStorageHolds(const Memory& m, const std::string& what) {
  // Without a storage (a tensor-like object), nothing to check against.
  if (m.size == 0 || m.storage.is_none()) return;
  bool held = m.data != nullptr;
  if (held) {
    try {
      const uintptr_t base = m.storage.attr("data_ptr")().cast<uintptr_t>();
      const size_t bytes = m.storage.attr("nbytes")().cast<size_t>();
      const uintptr_t start = reinterpret_cast<uintptr_t>(m.data);
      held = start >= base && start - base <= bytes &&
             m.size <= bytes - (start - base);
    } catch (const py::error_already_set&) {
      // A storage that cannot say (an old torch): taken as it is.
    }
  }
  if (!held) {
    throw py::value_error(absl::StrCat(
        "INVALID_ARGUMENT: ", what, "'s storage does not hold its ", m.size,
        " bytes (freed with resize_(0), or resized under it)"));
  }
}

bool IsTorchTensor(py::handle obj) {
  return py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size") &&
         py::hasattr(obj, "numel") && py::hasattr(obj, "is_contiguous");
}

// `what` names the argument in errors, e.g. "buffers[3]". `with_shape`
// fills Memory::shape (only caches need it: CacheView). REQUIRES: the GIL.
Memory GetMemory(py::handle obj, bool writable, const std::string& what,
                 bool with_shape = false) {
  Memory m;
  m.owner = py::reinterpret_borrow<py::object>(obj);
  if (IsTorchTensor(obj)) {
    py::object device = obj.attr("device");
    std::string type = py::str(device.attr("type"));
    if (type != "cpu") {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: ", what, " is a torch tensor on ", type,
          "; this build moves host memory only (CPU tensors)"));
    }
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw py::value_error(
          absl::StrCat("INVALID_ARGUMENT: ", what, " is not contiguous"));
    }
    m.data = reinterpret_cast<char*>(obj.attr("data_ptr")().cast<uintptr_t>());
    m.itemsize = obj.attr("element_size")().cast<size_t>();
    CheckByteOrder('@', m.itemsize, what,
                   "a torch tensor on a big-endian host");
    m.size = obj.attr("numel")().cast<size_t>() * m.itemsize;
    m.element = py::str(obj.attr("dtype"));
    if (absl::StartsWith(m.element, "torch.")) m.element.erase(0, 6);
    if (!with_shape) {
      // Not asked for.
    } else if (py::hasattr(obj, "shape")) {
      for (py::handle extent : obj.attr("shape")) {
        m.shape.push_back(extent.cast<int64_t>());
      }
    } else {
      m.shape = {
          static_cast<int64_t>(m.size / std::max<size_t>(1, m.itemsize))};
    }
    m.storage = TorchStorage(obj);
    CheckStorageHolds(m, what);
    return m;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error(absl::StrCat(
        what, " must support the buffer protocol (numpy array, bytes, "
              "bytearray, memoryview) or be a CPU torch tensor, not ",
        std::string(py::str(py::type::of(obj)))));
  }
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  Py_buffer* buf = new Py_buffer();
  if (PyObject_GetBuffer(obj.ptr(), buf, flags) != 0) {
    delete buf;
    // Why (not C-contiguous, read-only, an element type numpy exports no
    // buffer of, e.g. datetime64) is the exporter's message.
    throw py::value_error(absl::StrCat(
        "INVALID_ARGUMENT: ", what, " cannot be read as a C-contiguous",
        writable ? " writable" : "", " buffer: ", TakePythonErrorText()));
  }
  // buffer_info takes ownership of `buf` (releases and deletes it), also
  // when a check below throws.
  const std::string format = buf->format != nullptr ? buf->format : "B";
  m.view.emplace(buf, /*ownview=*/true);
  m.data = static_cast<char*>(buf->buf);
  m.size = static_cast<size_t>(buf->len);
  m.itemsize = static_cast<size_t>(std::max<py::ssize_t>(1, m.view->itemsize));
  m.element = format;
  char order = '@';
  if (!m.element.empty() && absl::StrContains("@=<>!", m.element[0])) {
    order = m.element[0];
    m.element.erase(0, 1);
  }
  if (!PlainElements(m.element)) {
    throw py::type_error(absl::StrCat(
        what, " holds elements of buffer format '", format,
        "'; kvdepot moves buffers of plain numbers or bytes only (numpy "
        "numeric dtypes, bytes, bytearray), never Python objects"));
  }
  CheckByteOrder(order, m.itemsize, what,
                 absl::StrCat("buffer format '", format, "'"));
  if (with_shape) m.shape.assign(m.view->shape.begin(), m.view->shape.end());
  return m;
}

std::vector<Memory> GetMemories(const py::sequence& objs, bool writable,
                                const char* what, bool with_shape = false) {
  std::vector<Memory> out;
  out.reserve(objs.size());
  for (size_t i = 0; i < objs.size(); ++i) {
    out.push_back(
        GetMemory(objs[i], writable, absl::StrCat(what, "[", i, "]"), with_shape));
  }
  return out;
}

// Raises ValueError when two of `memories`, buffers one call writes (`what`
// names them, e.g. "buffers"), share a byte: each is to receive a block of
// its own, and one would overwrite the other. Empty buffers share none.
// O(n log n).
void CheckNoOverlap(const std::vector<Memory>& memories, const char* what) {
  std::vector<size_t> order;
  order.reserve(memories.size());
  for (size_t i = 0; i < memories.size(); ++i) {
    if (memories[i].size > 0) order.push_back(i);
  }
  auto start = [&](size_t i) { return reinterpret_cast<uintptr_t>(memories[i].data); };
  auto end = [&](size_t i) { return start(i) + memories[i].size; };
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return start(a) < start(b); });
  // Sorted by start, and disjoint so far: a buffer overlaps an earlier one
  // exactly when it starts before the end of the one before it.
  for (size_t k = 1; k < order.size(); ++k) {
    if (start(order[k]) < end(order[k - 1])) {
      const size_t a = std::min(order[k], order[k - 1]);
      const size_t b = std::max(order[k], order[k - 1]);
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: ", what, "[", b, "] overlaps ", what, "[", a,
          "]; each block needs memory of its own"));
    }
  }
}

// Raises ValueError when one of `objects` shares a byte with one of
// `caches`: a gather would write an object over the cache it reads, a
// scatter read an object out of a cache it writes, a load stage a block in
// the cache it scatters into. Caches may share bytes with each other (a
// model whose layers share one KV cache, vLLM's KV sharing, passes that
// tensor for each of them). O(objects x caches): one cache per layer.
void CheckObjectsApartFromCaches(const std::vector<Memory>& objects,
                                 const std::vector<Memory>& caches) {
  for (size_t i = 0; i < objects.size(); ++i) {
    const auto start = reinterpret_cast<uintptr_t>(objects[i].data);
    const uintptr_t end = start + objects[i].size;
    for (size_t c = 0; c < caches.size(); ++c) {
      const auto cache_start = reinterpret_cast<uintptr_t>(caches[c].data);
      if (objects[i].size > 0 && start < cache_start + caches[c].size &&
          cache_start < end) {
        throw py::value_error(absl::StrCat(
            "INVALID_ARGUMENT: objects[", i, "] overlaps caches[", c,
            "]; a block's object needs memory apart from the caches"));
      }
    }
  }
}

// Python bytes keys, kept alive as std::string while the GIL is released.
std::vector<std::string> Keys(const std::vector<py::bytes>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const py::bytes& k : keys) out.push_back(std::string(k));
  return out;
}

std::vector<absl::string_view> Views(const std::vector<std::string>& keys) {
  return std::vector<absl::string_view>(keys.begin(), keys.end());
}

// A protobuf message as a dict (field names as in the .proto; nested
// messages as dicts, repeated fields as lists, enums by name). REQUIRES: the
// GIL.
py::object FieldValue(const google::protobuf::Message& msg,
                      const google::protobuf::FieldDescriptor* f, int index);

py::dict MessageToDict(const google::protobuf::Message& msg) {
  py::dict out;
  const google::protobuf::Descriptor* d = msg.GetDescriptor();
  const google::protobuf::Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      py::list values;
      for (int j = 0; j < r->FieldSize(msg, f); ++j) {
        values.append(FieldValue(msg, f, j));
      }
      out[py::str(f->name())] = values;
    } else {
      out[py::str(f->name())] = FieldValue(msg, f, -1);
    }
  }
  return out;
}

py::object FieldValue(const google::protobuf::Message& msg,
                      const google::protobuf::FieldDescriptor* f, int index) {
  using FD = google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = msg.GetReflection();
  bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FD::CPPTYPE_INT32:
      return py::int_(rep ? r->GetRepeatedInt32(msg, f, index) : r->GetInt32(msg, f));
    case FD::CPPTYPE_INT64:
      return py::int_(rep ? r->GetRepeatedInt64(msg, f, index) : r->GetInt64(msg, f));
    case FD::CPPTYPE_UINT32:
      return py::int_(rep ? r->GetRepeatedUInt32(msg, f, index)
                          : r->GetUInt32(msg, f));
    case FD::CPPTYPE_UINT64:
      return py::int_(rep ? r->GetRepeatedUInt64(msg, f, index)
                          : r->GetUInt64(msg, f));
    case FD::CPPTYPE_DOUBLE:
      return py::float_(rep ? r->GetRepeatedDouble(msg, f, index)
                            : r->GetDouble(msg, f));
    case FD::CPPTYPE_FLOAT:
      return py::float_(rep ? r->GetRepeatedFloat(msg, f, index) : r->GetFloat(msg, f));
    case FD::CPPTYPE_BOOL:
      return py::bool_(rep ? r->GetRepeatedBool(msg, f, index) : r->GetBool(msg, f));
    case FD::CPPTYPE_ENUM:
      return py::str(rep ? r->GetRepeatedEnum(msg, f, index)->name()
                         : r->GetEnum(msg, f)->name());
    case FD::CPPTYPE_STRING: {
      std::string s = rep ? r->GetRepeatedString(msg, f, index) : r->GetString(msg, f);
      if (f->type() == FD::TYPE_BYTES) return py::bytes(s);
      return py::str(s);
    }
    case FD::CPPTYPE_MESSAGE:
      return MessageToDict(rep ? r->GetRepeatedMessage(msg, f, index)
                               : r->GetMessage(msg, f));
  }
  return py::none();
}

// Per block: whether its status is OK (TransferOp.ok, CacheLoad.ok).
std::vector<bool> OkFlags(const std::vector<absl::Status>& statuses) {
  std::vector<bool> out;
  out.reserve(statuses.size());
  for (const absl::Status& s : statuses) out.push_back(s.ok());
  return out;
}

// Per block: None when OK, else (code name, message), e.g. ("NOT_FOUND",
// "not stored") (TransferOp.errors, CacheLoad.errors). REQUIRES: the GIL.
py::list ErrorList(const std::vector<absl::Status>& statuses) {
  py::list out;
  for (const absl::Status& s : statuses) {
    if (s.ok()) {
      out.append(py::none());
    } else {
      out.append(py::make_tuple(absl::StatusCodeToString(s.code()),
                                std::string(s.message())));
    }
  }
  return out;
}

// Calls wait_until(t) with the GIL released, for deadlines t in slices of
// at most 100 ms, until it returns true or `timeout` seconds have passed
// (None: no limit; 0: one poll); returns whether it returned true. Between
// slices, KeyboardInterrupt and other signal handlers run. REQUIRES: the
// GIL; wait_until touches no Python object.
template <typename WaitUntil>
bool WaitReleased(std::optional<double> timeout, WaitUntil wait_until) {
  if (timeout && std::isnan(*timeout)) {
    throw py::value_error("INVALID_ARGUMENT: timeout is NaN");
  }
  const absl::Time deadline = timeout
                                  ? absl::Now() + absl::Seconds(std::max(0.0, *timeout))
                                  : absl::InfiniteFuture();
  for (;;) {
    absl::Time until = std::min(deadline, absl::Now() + absl::Milliseconds(100));
    bool ready = false;
    {
      py::gil_scoped_release release;
      ready = wait_until(until);
    }
    if (ready) return true;
    if (absl::Now() >= deadline) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// The binding of one TransferOp (a get_into_async or put_async batch) and
// the owner of everything the batch uses: the Python objects whose memory it
// reads or writes (with their buffer-protocol exports, which also keep
// bytearrays and numpy arrays from being resized) and the native client,
// whose UCX completion callback runs on a gRPC thread.
//
// Lifetime: those references are dropped only once the op is ready --
// the memory objects when wait(), ready() or a result accessor first sees
// it ready, the client by wait() or the destructor (dropping it may close
// the session, an RPC, which ready() must not wait for) -- or, for an op
// dropped while still in flight, by the destructor, which first waits for
// the batch with the GIL released. The wait is bounded by the client's RPC
// deadline (timeout_s). The transfer never needs the GIL to finish, so the
// wait cannot deadlock on it.
//
// Thread-safe for Python callers: every method runs with the GIL held, and
// where one releases it (around the native wait, and to drop the client) it
// touches only the TransferOp, which is thread-safe, or locals.
class PyTransferOp {
 public:
  PyTransferOp(std::shared_ptr<Client> client, std::vector<Memory> memory)
      : client_(std::move(client)), memory_(std::move(memory)) {}

  // REQUIRES: the GIL (pybind11 destroys instances holding it).
  ~PyTransferOp() {
    if (client_ == nullptr && memory_.empty()) return;
    if (born_ != Forks()) {
      Settle();  // the parent's op: nothing here to wait for (CountFork)
      return;
    }
    {
      py::gil_scoped_release release;
      if (op_) op_->Wait();
    }
    Settle();
  }

  PyTransferOp(const PyTransferOp&) = delete;
  PyTransferOp& operator=(const PyTransferOp&) = delete;

  // Sets the op once it has been started. Needs no GIL (called by the one
  // thread that owns this object before Python sees it).
  void Start(TransferOp op) { op_.emplace(std::move(op)); }

  bool Ready() {
    if (!op_->IsReady()) {
      // In a child it never will be (see CountFork): a polling loop would
      // spin for ever.
      if (born_ != Forks()) RaiseMadeBeforeFork("TransferOp");
      return false;
    }
    Settle(/*drop_client=*/false);
    return true;
  }

  // Waits up to `timeout` seconds (forever with None; 0 polls), the GIL
  // released (see WaitReleased).
  bool Wait(std::optional<double> timeout) {
    if (born_ != Forks() && !op_->IsReady()) RaiseMadeBeforeFork("TransferOp");
    bool ready =
        WaitReleased(timeout, [this](absl::Time t) { return op_->WaitUntil(t); });
    if (ready) Settle();
    return ready;
  }

  std::vector<bool> Ok() {
    RequireReady("ok");
    return OkFlags(op_->statuses());
  }

  py::list Errors() {
    RequireReady("errors");
    return ErrorList(op_->statuses());
  }

  size_t OkPrefix() {
    RequireReady("ok_prefix");
    return op_->ok_prefix();
  }

  bool AlreadyStored(py::ssize_t i) {
    RequireReady("already_stored");
    const auto n = static_cast<py::ssize_t>(op_->statuses().size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) {
      throw py::index_error(absl::StrCat("block index out of range (", n, " blocks)"));
    }
    return op_->already_stored(static_cast<size_t>(i));
  }

  std::string Transport() {
    RequireReady("transport");
    return op_->transport();
  }

  // The number of blocks; known before the op is ready.
  size_t size() const { return size_; }
  void set_size(size_t n) { size_ = n; }

  // "TransferOp(4 blocks, ready, 3 ok, transport=ucx)" or "(4 blocks, in
  // flight)". Does not settle the op.
  std::string Repr() {
    if (!op_->IsReady()) return absl::StrCat("TransferOp(", size_, " blocks, in flight)");
    size_t ok = 0;
    for (const absl::Status& s : op_->statuses()) ok += s.ok() ? 1 : 0;
    return absl::StrCat("TransferOp(", size_, " blocks, ready, ", ok,
                        " ok, transport=", op_->transport(), ")");
  }

 private:
  void RequireReady(const char* what) {
    if (!op_->IsReady() && born_ != Forks()) RaiseMadeBeforeFork("TransferOp");
    if (!op_->IsReady()) {
      throw std::runtime_error(absl::StrCat(
          "FAILED_PRECONDITION: TransferOp.", what,
          "() before the transfer is ready; call wait() (or poll ready()) "
          "first"));
    }
    Settle(/*drop_client=*/false);
  }

  // Drops the references the batch needed: the memory objects, and with
  // `drop_client` the client. REQUIRES: the GIL, and the op ready (or never
  // started). The client goes with the GIL released: when the op holds its
  // last reference (close() was called meanwhile), its destructor closes
  // the session, an RPC of up to the client's timeout, so ready() and the
  // result accessors, which never block, leave it to wait() and the
  // destructor. The memory objects go after it, moved out first because
  // releasing them may run Python code that calls back here.
  void Settle(bool drop_client = true) {
    std::vector<Memory> memory = std::move(memory_);
    memory_.clear();
    if (!drop_client || client_ == nullptr) return;
    std::shared_ptr<Client> client = std::move(client_);
    client_ = nullptr;
    py::gil_scoped_release release;
    client.reset();
  }

  std::optional<TransferOp> op_;  // set by Start before Python sees it
  size_t size_ = 0;
  const uint64_t born_ = Forks();  // see CountFork
  // Held until the op is ready; then null and empty.
  std::shared_ptr<Client> client_;
  std::vector<Memory> memory_;
};

// True when elements of type `element` (Memory::element) may hold a cache of
// `dtype`: that type itself, or integers (raw bits: a uint8 view, numpy's
// uint16 for bf16, which numpy lacks). Another floating-point type may not.
bool ElementFits(const std::string& element, KvDtype dtype) {
  const bool floating =
      absl::StartsWith(element, "float") || absl::StartsWith(element, "bfloat") ||
      absl::StartsWith(element, "complex") ||
      (element.size() == 1 && absl::StrContains("efdg", element[0])) ||
      absl::StartsWith(element, "Z");  // complex formats: "Zf", "Zd"...
  if (!floating) return true;
  switch (dtype) {
    case KvDtype::kFloat16:
      return element == "float16" || element == "e";
    case KvDtype::kBFloat16:
      return element == "bfloat16";
    case KvDtype::kFloat8E4M3:
      return element == "float8_e4m3fn";
    case KvDtype::kFloat32:
      return element == "float32" || element == "f";
  }
  return false;
}

// The physical shape of a cache tensor of `layout` with `num_blocks` blocks
// (gpu/kv_layout.h), and the same in letters for messages.
std::vector<int64_t> PhysicalShape(const KvLayout& layout, int64_t num_blocks,
                                   std::string* letters) {
  const int64_t n = num_blocks, l = layout.num_layers(),
                c = layout.num_components(), t = layout.block_size(),
                h = layout.num_kv_heads(), d = layout.head_size();
  switch (layout.layout()) {
    case KvCacheLayout::kFlashAttnNhd:
      *letters = "[2, N, T, H, D]";
      return {c, n, t, h, d};
    case KvCacheLayout::kFlashAttnHnd:
      *letters = "[2, N, H, T, D]";
      return {c, n, h, t, d};
    case KvCacheLayout::kFlashInferNhd:
      *letters = "[N, 2, T, H, D]";
      return {n, c, t, h, d};
    case KvCacheLayout::kFlashInferHnd:
      *letters = "[N, 2, H, T, D]";
      return {n, c, h, t, d};
    case KvCacheLayout::kMla:
      *letters = "[N, T, D]";
      return {n, t, d};
    case KvCacheLayout::kCrossLayerNhd:
      *letters = "[N, L, C, T, H, D]";
      return {n, l, c, t, h, d};
    case KvCacheLayout::kCrossLayerHnd:
      *letters = "[N, L, C, H, T, D]";
      return {n, l, c, h, t, d};
  }
  *letters = "?";
  return {};
}

// `shape` (of elements of `itemsize` bytes) with its last dimension in bytes
// and without the dimensions of extent 1, which order no bytes: C-contiguous
// tensors of equal byte shapes lay each index out in the same bytes,
// whatever integer type views them.
std::vector<int64_t> ByteShape(std::vector<int64_t> shape, size_t itemsize) {
  if (!shape.empty()) shape.back() *= static_cast<int64_t>(itemsize);
  shape.erase(std::remove(shape.begin(), shape.end(), int64_t{1}), shape.end());
  return shape;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The cache tensors of a gather/scatter as a KvCacheView; num_blocks is
// derived from the tensors' sizes, which must all be equal and a whole number
// of blocks. Raises ValueError for elements of another floating-point type
// than the layout's, and for a tensor of more than one dimension whose shape
// is not the layout's physical one. `memories` keeps the objects referenced.
KvCacheView CacheView(const KvLayout& layout, const std::vector<Memory>& memories) {
  for (size_t i = 0; i < memories.size(); ++i) {
    // The fingerprint names the dtype: a cache of another one would be
    // stored as, or loaded from, blocks of this layout's.
    if (!ElementFits(memories[i].element, layout.dtype())) {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: caches[", i, "] holds ", memories[i].element,
          " elements but the layout's dtype is ", KvDtypeName(layout.dtype()),
          " (give tensors of that dtype, or an integer view of their bits)"));
    }
  }
  if (static_cast<int>(memories.size()) != layout.num_tensors()) {
    throw py::value_error(absl::StrCat(
        "INVALID_ARGUMENT: layout ", KvCacheLayoutName(layout.layout()), " with ",
        layout.num_layers(), " layers takes ", layout.num_tensors(),
        " cache tensors, got ", memories.size()));
  }
  uint64_t per_block = Check(layout.TensorBytes(1));
  KvCacheView view;
  view.num_blocks = static_cast<int64_t>(memories[0].size / per_block);
  for (size_t i = 0; i < memories.size(); ++i) {
    const Memory& m = memories[i];
    if (m.size != memories[0].size || m.size % per_block != 0 || m.size == 0) {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: caches[", i, "] has ", m.size,
          " bytes; every cache "
          "tensor must have the same size, a positive multiple of ",
          per_block, " bytes (one block)"));
    }
    view.tensors.push_back(m.data);
  }
  // A tensor of more than one dimension must have the layout's physical
  // shape: another layout's tensor of the same size (FlashInfer's [N, 2,
  // ...] as FlashAttention, HND as NHD) would give wrong objects, and
  // layouts share namespaces (the fingerprint leaves the physical order
  // out). 1-D buffers are taken by their size.
  std::string letters;
  const std::vector<int64_t> expected =
      PhysicalShape(layout, view.num_blocks, &letters);
  const std::vector<int64_t> want = ByteShape(expected, layout.element_bytes());
  for (size_t i = 0; i < memories.size(); ++i) {
    const Memory& m = memories[i];
    if (m.shape.size() > 1 && ByteShape(m.shape, m.itemsize) != want) {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: caches[", i, "] has shape ", ShapeText(m.shape),
          "; layout ", KvCacheLayoutName(layout.layout()),
          " takes tensors of shape ", ShapeText(expected), " (physically ",
          letters,
          "; an integer view of other width may differ in the last dimension, "
          "a "
          "1-D buffer in shape)"));
    }
  }
  return view;
}

// One load of blocks into a paged KV cache (Client.load_into_cache_async),
// run by one loader thread (Run): it starts a GetIntoAsync read of each
// batch into its staging objects, then scatters the hits of the batches that
// have arrived into the cache, one layer of one batch at a time. Layers
// become ready in order: layer l is ready once every batch has arrived and
// has scattered layers [0, l] of its hits (a batch without hits has nothing
// to scatter).
//
// A scatter that fails (not expected: the input was checked) fails the hits
// of its batch, which then hold some layers only: the failed layer and every
// later one never become ready (ready_layers() stops below it), and waiting
// for them reports the failure once the load is done (failure()), as
// gpu/staging.h's PendingTransfer::WaitForLayer does.
//
// Order of the scatter: the loader always takes the lowest layer left of any
// batch that has arrived (the lowest batch among equals). While later batches
// are in flight it works through the layers of the earlier ones; when the
// last batch arrives, its layer 0 comes next, so layer 0 is ready one
// single-layer scatter after the last arrival, and each later layer as soon
// as its pieces are done -- no batch's whole object stands in the way.
//
// Memory is borrowed: the cache tensors and the staging objects must stay
// valid, and the client alive, until done() (CacheLoad holds them). The
// loader touches no Python object and never takes the GIL.
//
// Thread-safe.
class CacheLoadState {
 public:
  // Block i is keys[i], read into objects[i] (layout.object_bytes() each)
  // and scattered into block_ids[i] of `cache`; batch b is blocks
  // [bounds[b], bounds[b + 1]). REQUIRES: valid, distinct block ids;
  // bounds ascending from 0 to keys.size().
  CacheLoadState(Client& client, std::string ns, std::vector<std::string> keys,
                 std::vector<char*> objects, KvLayout layout, KvCacheView cache,
                 std::vector<int64_t> block_ids, std::vector<size_t> bounds)
      : client_(client),
        ns_(std::move(ns)),
        keys_(std::move(keys)),
        objects_(std::move(objects)),
        layout_(std::move(layout)),
        cache_(std::move(cache)),
        block_ids_(std::move(block_ids)),
        bounds_(std::move(bounds)),
        statuses_(keys_.size(), absl::UnknownError("not loaded")) {}

  CacheLoadState(const CacheLoadState&) = delete;
  CacheLoadState& operator=(const CacheLoadState&) = delete;

  // The loader's body; returns once done() (every batch ready, every hit
  // scattered, or the load cancelled).
  void Run() {
    const int num_layers = layout_.num_layers();
    const size_t num_batches = this->num_batches();
    std::vector<TransferOp> ops;
    ops.reserve(num_batches);
    {
      const std::vector<absl::string_view> keys(keys_.begin(), keys_.end());
      std::vector<absl::Span<char>> dst;
      dst.reserve(objects_.size());
      for (char* o : objects_) dst.emplace_back(o, layout_.object_bytes());
      for (size_t b = 0; b < num_batches && !cancelled(); ++b) {
        const size_t lo = bounds_[b], n = bounds_[b + 1] - lo;
        ops.push_back(client_.GetIntoAsync(
            ns_, absl::MakeConstSpan(keys).subspan(lo, n),
            absl::MakeConstSpan(dst).subspan(lo, n)));
        absl::MutexLock lock(&mu_);
        ++started_batches_;
      }
    }
    std::vector<bool> arrived(ops.size(), false);
    std::vector<int> next(ops.size(), 0);  // layers of the batch scattered
    std::vector<std::vector<size_t>> hits(ops.size());
    size_t in_flight = ops.size();
    while (!cancelled()) {
      for (size_t b = 0; b < ops.size(); ++b) {
        if (arrived[b] || !ops[b].IsReady()) continue;
        arrived[b] = true;
        --in_flight;
        const std::vector<absl::Status>& st = ops[b].statuses();
        for (size_t i = bounds_[b]; i < bounds_[b + 1]; ++i) {
          statuses_[i] = st[i - bounds_[b]];
          if (statuses_[i].ok()) hits[b].push_back(i);
        }
        if (hits[b].empty()) next[b] = num_layers;
      }
      size_t best = ops.size();
      for (size_t b = 0; b < ops.size(); ++b) {
        if (arrived[b] && next[b] < num_layers &&
            (best == ops.size() || next[b] < next[best])) {
          best = b;
        }
      }
      if (best < ops.size()) {
        absl::Status s = ScatterLayer(hits[best], next[best]);
        if (s.ok()) {
          ++next[best];
        } else {  // not expected: the input was checked
          const absl::Status failed(
              s.code(),
              absl::StrCat("scatter of layer ", next[best], ": ", s.message()));
          for (size_t i : hits[best]) statuses_[i] = failed;
          hits[best].clear();
          absl::MutexLock lock(&mu_);
          if (failure_.ok()) failure_ = failed;
          failed_layer_ = std::min(failed_layer_, next[best]);
          next[best] = num_layers;  // nothing more of this batch to scatter
        }
        int ready = num_layers;
        for (size_t b = 0; b < ops.size(); ++b) {
          ready = std::min(ready, arrived[b] ? next[b] : 0);
        }
        absl::MutexLock lock(&mu_);
        ready_layers_ = std::min(ready, failed_layer_);
        continue;
      }
      if (in_flight == 0) break;
      // Nothing to scatter: wait for the first batch in flight; while others
      // are in flight too, for a slice only, to see one that arrives first.
      for (size_t b = 0; b < ops.size(); ++b) {
        if (arrived[b]) continue;
        ops[b].WaitUntil(in_flight == 1 ? absl::InfiniteFuture()
                                        : absl::Now() + absl::Milliseconds(1));
        break;
      }
    }
    // Cancelled: the batches still in flight write into the staging objects
    // and use the client until they are ready.
    for (const TransferOp& op : ops) op.Wait();
    // Then the hits not wholly scattered, and the blocks of batches seen
    // ready only now or never started, end CANCELLED.
    for (size_t b = 0; b < num_batches; ++b) {
      const bool seen = b < ops.size() && arrived[b];
      if (seen && next[b] >= num_layers) continue;
      for (size_t i = bounds_[b]; i < bounds_[b + 1]; ++i) {
        if (!seen || statuses_[i].ok()) {
          statuses_[i] = absl::CancelledError("the load was cancelled");
        }
      }
    }
    absl::MutexLock lock(&mu_);
    // Also when nothing was hit; never past a layer whose scatter failed.
    if (!cancelled_) ready_layers_ = std::min(num_layers, failed_layer_);
    done_ = true;
  }

  // Scatters no further layer; the loader then waits for the batches in
  // flight and is done. The blocks not wholly scattered end CANCELLED.
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }

  size_t size() const { return keys_.size(); }
  int num_layers() const { return layout_.num_layers(); }
  size_t num_batches() const { return bounds_.size() - 1; }

  // Batches whose reads have been started (all of them, unless the load
  // was cancelled first); for diagnostics.
  size_t started_batches() const {
    absl::MutexLock lock(&mu_);
    return started_batches_;
  }

  // Layers [0, ready_layers()) of every hit are in the cache. num_layers()
  // once done, unless cancelled or a scatter failed (then below the layer
  // that failed).
  int ready_layers() const {
    absl::MutexLock lock(&mu_);
    return ready_layers_;
  }

  // OK, or the first scatter's failure (see the class comment).
  absl::Status failure() const {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

  bool done() const {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  // Waits until ready_layers() >= n or done(), or `deadline`; returns
  // whether ready_layers() >= n.
  bool WaitLayers(int n, absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return ready_layers_ >= n || done_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
    return ready_layers_ >= n;
  }

  // Waits until done() or `deadline`; returns done().
  bool WaitDone(absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&done_), deadline);
    return done_;
  }

  // REQUIRES: done(). One status per block: the read's (NOT_FOUND for a
  // key not stored), a scatter error, or CANCELLED.
  const std::vector<absl::Status>& statuses() const { return statuses_; }

 private:
  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  // Scatters layer `layer` of the blocks `hits` from their staging objects.
  absl::Status ScatterLayer(const std::vector<size_t>& hits, int layer) const {
    std::vector<int64_t> ids;
    std::vector<const void*> src;
    ids.reserve(hits.size());
    src.reserve(hits.size());
    const uint64_t offset = static_cast<uint64_t>(layer) * layout_.layer_bytes();
    for (size_t i : hits) {
      ids.push_back(block_ids_[i]);
      src.push_back(objects_[i] + offset);
    }
    return Scatter(layout_, cache_, ids, LayerRange{layer, layer + 1}, src,
                   StreamRef());
  }

  // Constant after construction; borrowed memory, see the class comment.
  Client& client_;
  const std::string ns_;
  const std::vector<std::string> keys_;
  const std::vector<char*> objects_;
  const KvLayout layout_;
  const KvCacheView cache_;
  const std::vector<int64_t> block_ids_;
  const std::vector<size_t> bounds_;

  // Written by the loader before it sets done_; read by others only after
  // they have seen done_ (under mu_).
  std::vector<absl::Status> statuses_;

  mutable absl::Mutex mu_;
  int ready_layers_ ABSL_GUARDED_BY(mu_) = 0;
  // The lowest layer whose scatter failed (num_layers while none did), and
  // the first failure.
  int failed_layer_ ABSL_GUARDED_BY(mu_) = layout_.num_layers();
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  size_t started_batches_ ABSL_GUARDED_BY(mu_) = 0;
};

// The binding of one CacheLoadState (Python: CacheLoad) and the owner of
// everything it uses: the cache tensors' and staging objects' Python objects
// (with their buffer-protocol exports), the native client, and the loader
// thread. They go once the load is seen done (wait(), ready(),
// wait_for_layer() or a result accessor; the thread is joined then), the
// client by wait() or the destructor only (see Settle). A
// CacheLoad dropped before that cancels the load -- no further layer is
// scattered -- and its destructor waits, with the GIL released, until the
// batches in flight are ready and the loader has ended, so no memory is
// freed or reused under a transfer or a scatter. That wait is bounded by the
// client's transfer deadlines.
//
// Thread-safe for Python callers: every method runs with the GIL held, and
// where one releases it, it touches only the state (thread-safe) or locals.
class PyCacheLoad {
 public:
  PyCacheLoad(std::shared_ptr<Client> client, std::vector<Memory> memory,
              std::shared_ptr<CacheLoadState> state)
      : client_(std::move(client)),
        memory_(std::move(memory)),
        state_(std::move(state)) {}

  // REQUIRES: the GIL (pybind11 destroys instances holding it).
  ~PyCacheLoad() {
    if (born_ != Forks()) {
      // The parent's load (CountFork): its loader thread is not here to
      // wait for or join; the thread object goes unjoined.
      static_cast<void>(thread_.release());
      settled_ = true;
      Settle();
      return;
    }
    if (!settled_) {
      state_->Cancel();
      py::gil_scoped_release release;
      state_->WaitDone(absl::InfiniteFuture());
    }
    Settle();  // the client too, without the GIL
  }

  PyCacheLoad(const PyCacheLoad&) = delete;
  PyCacheLoad& operator=(const PyCacheLoad&) = delete;

  // Starts the loader thread (once, before Python sees the object). Where
  // no thread can be had (std::system_error, std::bad_alloc), loads here
  // instead, with the GIL released: the load must run, or the destructor
  // would wait for it forever. REQUIRES: the GIL.
  void Start() {
    try {
      thread_ =
          std::make_unique<std::thread>([state = state_] { state->Run(); });
    } catch (const std::exception&) {
      py::gil_scoped_release release;
      state_->Run();
    }
  }

  int ReadyLayers() const { return state_->ready_layers(); }

  bool Ready() {
    if (!state_->done()) {
      if (born_ != Forks())
        RaiseMadeBeforeFork("CacheLoad");  // as TransferOp's
      return false;
    }
    Settle(/*drop_client=*/false);
    return true;
  }

  // Waits until layers [0, layer] are ready or `timeout` seconds pass;
  // returns whether they are. Raises the scatter's failure once the load is
  // done without them (see CacheLoadState).
  bool WaitForLayer(int layer, std::optional<double> timeout) {
    if (born_ != Forks() && !state_->done()) RaiseMadeBeforeFork("CacheLoad");
    if (layer < 0 || layer >= state_->num_layers()) {
      Raise(absl::OutOfRangeError(absl::StrCat(
          "layer ", layer, " is outside [0, ", state_->num_layers(), ")")));
    }
    // Until the layers are ready or the load is done: a failed layer never
    // becomes ready.
    WaitReleased(timeout, [this, layer](absl::Time t) {
      return state_->WaitLayers(layer + 1, t) || state_->done();
    });
    const bool ready = state_->ready_layers() > layer;
    if (state_->done()) {
      Settle(/*drop_client=*/false);
      absl::Status failure = state_->failure();
      if (!ready && !failure.ok()) Raise(failure);
    }
    return ready;
  }

  bool Wait(std::optional<double> timeout) {
    if (born_ != Forks() && !state_->done()) RaiseMadeBeforeFork("CacheLoad");
    bool ready =
        WaitReleased(timeout, [this](absl::Time t) { return state_->WaitDone(t); });
    if (ready) Settle();
    return ready;
  }

  std::vector<bool> Ok() {
    RequireDone("ok");
    return OkFlags(state_->statuses());
  }

  py::list Errors() {
    RequireDone("errors");
    return ErrorList(state_->statuses());
  }

  size_t size() const { return state_->size(); }
  int num_layers() const { return state_->num_layers(); }

  // "CacheLoad(4 blocks, 2 of 2 batches started, 3 of 32 layers ready)" or
  // "CacheLoad(4 blocks, done, 3 loaded)". Does not settle the load.
  std::string Repr() const {
    if (!state_->done()) {
      return absl::StrCat("CacheLoad(", size(), " blocks, ",
                          state_->started_batches(), " of ", state_->num_batches(),
                          " batches started, ", ReadyLayers(), " of ",
                          num_layers(), " layers ready)");
    }
    size_t ok = 0;
    for (const absl::Status& s : state_->statuses()) ok += s.ok() ? 1 : 0;
    return absl::StrCat("CacheLoad(", size(), " blocks, done, ", ok, " loaded)");
  }

 private:
  void RequireDone(const char* what) {
    if (!state_->done() && born_ != Forks()) RaiseMadeBeforeFork("CacheLoad");
    if (!state_->done()) {
      throw std::runtime_error(absl::StrCat(
          "FAILED_PRECONDITION: CacheLoad.", what,
          "() before the load is done; call wait() (or poll ready()) first"));
    }
    Settle(/*drop_client=*/false);
  }

  // Joins the loader and drops the references the load needed: the memory
  // objects, and with `drop_client` the client. REQUIRES: the GIL, and the
  // state done. The join does not wait: a done loader only returns. The
  // client goes with the GIL released, and only from wait() and the
  // destructor: as PyTransferOp::Settle, its last reference closes the
  // session (an RPC), and ready(), wait_for_layer() and the result
  // accessors do not block on it. The memory objects go after it, moved out
  // first because releasing them may run Python code that calls back here.
  void Settle(bool drop_client = true) {
    std::vector<Memory> memory;
    if (!settled_) {
      settled_ = true;
      if (thread_ != nullptr && thread_->joinable()) thread_->join();
      memory = std::move(memory_);
      memory_.clear();
    }
    if (!drop_client || client_ == nullptr) return;
    std::shared_ptr<Client> client = std::move(client_);
    client_ = nullptr;
    py::gil_scoped_release release;
    client.reset();
  }

  // Held until settled; then null and empty.
  std::shared_ptr<Client> client_;
  std::vector<Memory> memory_;
  const std::shared_ptr<CacheLoadState> state_;
  std::unique_ptr<std::thread> thread_;  // null where the load ran inline
  bool settled_ = false;  // the GIL guards it
  const uint64_t born_ = Forks();  // see CountFork
};

// Raises ValueError unless `ns` and every key are valid (the native async
// calls would report them per block instead).
void ValidateNames(const std::string& ns, const std::vector<std::string>& keys) {
  Check(ValidateNamespace(ns));
  for (size_t i = 0; i < keys.size(); ++i) {
    Check(ValidateKey(keys[i], absl::StrCat("keys[", i, "]")));
  }
}

bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Runs fn() without the GIL where this thread holds it (except while the
// interpreter shuts down), else as it is: for what may block (an RPC,
// stopping UCX workers, unmapping memory) in code that runs both with and
// without the GIL (deleters, capsule destructors).
template <typename Fn>
void WithoutGil(Fn&& fn) {
  if (PyGILState_Check() && !InterpreterFinalizing()) {
    py::gil_scoped_release nogil;
    fn();
  } else {
    fn();
  }
}

// The Client binding: one libkvdepot Client (thread-safe; Python threads may
// share it).
//
// Two references to the native client: native_ owns it (and so do the
// arrays of allocate_buffer, whose memory it holds); client_ is for using
// it (calls, and the ops and loads in flight hold it) and closes the session
// when its last holder lets go. So close() ends the session, releasing its
// pins, as soon as no op is in flight, even while arrays of allocate_buffer
// live on (their memory stays valid until they go, and with the last of
// them the native client).
class PyClient {
 public:
  PyClient(const std::string& server, double timeout_s, double lease_s,
           const std::string& client_name) {
    ClientOptions options;
    options.server = server;
    if (!(timeout_s > 0) || !std::isfinite(timeout_s)) {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: timeout_s must be a positive number of seconds, not ",
          timeout_s));
    }
    if (!(lease_s >= 0) || !std::isfinite(lease_s)) {
      throw py::value_error(absl::StrCat(
          "INVALID_ARGUMENT: lease_s must be 0 (the daemon's default) or a "
          "positive number of seconds, not ",
          lease_s));
    }
    options.rpc_timeout = absl::Seconds(timeout_s);
    options.lease = absl::Seconds(lease_s);  // its range: Client::Connect
    options.client_name = client_name;
    if (grpc_unusable.load(std::memory_order_relaxed)) {
      Raise(absl::FailedPreconditionError(
          "this process was forked from one that had made a kvdepot.Client: "
          "gRPC cannot be used in it (a new Client would break the parent's "
          "connection, or hang). Start worker processes with "
          "multiprocessing's 'spawn' or 'forkserver', or fork before the "
          "first kvdepot.Client"));
    }
    clients_made.store(true, std::memory_order_relaxed);
    absl::StatusOr<std::unique_ptr<Client>> connected;
    {
      // Resolving the server's name (to pick UCX's devices) and starting UCX
      // take milliseconds to seconds.
      py::gil_scoped_release release;
      connected = Client::Connect(options);
    }
    std::unique_ptr<Client> client = Check(std::move(connected));
    // The objects whose memory register_buffer handed to the client live as
    // long as the client does (UCX keeps the registrations until then):
    // released, with the GIL, after it is gone.
    auto registered = std::make_shared<std::vector<Memory>>();
    registered_ = registered.get();
    const uint64_t born = born_;
    native_ = std::shared_ptr<Client>(client.release(),
                                      [registered, born](Client* c) {
                                        // ~Client closes the session, if one is
                                        // left (an RPC, up to a few seconds
                                        // with a daemon that does not answer)
                                        // and stops the UCX workers: without
                                        // the GIL, whoever drops the last
                                        // reference (del, the garbage
                                        // collector, an array's capsule). In a
                                        // forked child the client is the
                                        // parent's (CountFork): left as it is.
                                        if (born == Forks())
                                          WithoutGil([c] { delete c; });
                                        py::gil_scoped_acquire gil;
                                        registered->clear();
                                      });
    client_ = std::shared_ptr<Client>(
        native_.get(), [native = native_, born](Client* c) mutable {
          // Nothing uses the client any more: close its session (an RPC)
          // now, whatever still holds its memory (not the parent's
          // session from a forked child).
          WithoutGil([c, &native, born] {
            if (born == Forks()) c->CloseSession().IgnoreError();
            native.reset();
          });
        });
    server_ = server;
  }

  void Health() {
    Check(Released([](Client& c) { return c.Health(); }));
  }

  uint64_t EnsureSession() {
    return Check(Released([](Client& c) { return c.EnsureSession(); }));
  }

  void CloseSession() {
    Check(Released([](Client& c) { return c.CloseSession(); }));
  }

  LookupReply Lookup(const std::string& ns, const std::vector<py::bytes>& keys,
                     bool prefix, bool pin) {
    std::vector<std::string> k = Keys(keys);
    return Check(Released([&](Client& c) {
      std::vector<absl::string_view> v = Views(k);
      return c.Lookup(ns, v, prefix, pin);
    }));
  }

  // Put and PutAsync: one buffer, and one parent if any, per key.
  static void CheckPutCounts(const std::vector<py::bytes>& keys,
                             const py::sequence& buffers,
                             const std::optional<std::vector<py::bytes>>& parents) {
    if (static_cast<size_t>(buffers.size()) != keys.size()) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: ", keys.size(),
                                         " keys but ", buffers.size(), " buffers"));
    }
    if (parents && parents->size() != keys.size()) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: ", keys.size(),
                                         " keys but ", parents->size(), " parents"));
    }
  }

  void Unpin(uint64_t pin_id) {
    Check(Released([&](Client& c) { return c.Unpin(pin_id); }));
  }

  std::vector<bool> Put(const std::string& ns, const std::vector<py::bytes>& keys,
                        const py::sequence& buffers,
                        const std::optional<std::vector<py::bytes>>& parents) {
    CheckPutCounts(keys, buffers, parents);
    std::vector<std::string> k = Keys(keys);
    std::vector<std::string> p = parents ? Keys(*parents) : std::vector<std::string>();
    std::vector<Memory> mem = GetMemories(buffers, /*writable=*/false, "buffers");
    std::vector<PutResult> r = Check(Released([&](Client& c) {
      std::vector<BlockToPut> blocks(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        blocks[i].key = k[i];
        if (!p.empty()) blocks[i].parent = p[i];
        blocks[i].bytes = absl::string_view(mem[i].data, mem[i].size);
      }
      return c.Put(ns, blocks);
    }));
    std::vector<bool> stored;
    stored.reserve(r.size());
    for (PutResult x : r) stored.push_back(x == PutResult::kStored);
    return stored;
  }

  std::vector<bool> GetInto(const std::string& ns, const std::vector<py::bytes>& keys,
                            const py::sequence& buffers) {
    if (static_cast<size_t>(buffers.size()) != keys.size()) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: ", keys.size(),
                                         " keys but ", buffers.size(), " buffers"));
    }
    std::vector<std::string> k = Keys(keys);
    std::vector<Memory> mem = GetMemories(buffers, /*writable=*/true, "buffers");
    CheckNoOverlap(mem, "buffers");
    return Check(Released([&](Client& c) {
      std::vector<absl::string_view> v = Views(k);
      std::vector<absl::Span<char>> dst;
      dst.reserve(mem.size());
      for (const Memory& m : mem) dst.emplace_back(m.data, m.size);
      return c.GetInto(ns, v, dst);
    }));
  }

  // Starts reading blocks into `buffers` (as GetInto; over UCX when every
  // buffer lies in allocated or registered memory, else over gRPC, done
  // before this returns). Bad input raises here; per-block outcomes, misses
  // included, are the op's.
  std::unique_ptr<PyTransferOp> GetIntoAsync(const std::string& ns,
                                             const std::vector<py::bytes>& keys,
                                             const py::sequence& buffers,
                                             bool prefix) {
    if (static_cast<size_t>(buffers.size()) != keys.size()) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: ", keys.size(),
                                         " keys but ", buffers.size(), " buffers"));
    }
    std::vector<std::string> k = Keys(keys);
    ValidateNames(ns, k);
    std::vector<Memory> mem = GetMemories(buffers, /*writable=*/true, "buffers");
    CheckNoOverlap(mem, "buffers");
    std::vector<absl::Span<char>> dst;
    dst.reserve(mem.size());
    for (const Memory& m : mem) dst.emplace_back(m.data, m.size);
    std::shared_ptr<Client> c = client();
    // The op owns the memory before the transfer can touch it.
    auto op = std::make_unique<PyTransferOp>(c, std::move(mem));
    op->set_size(k.size());
    {
      py::gil_scoped_release release;
      std::vector<absl::string_view> v = Views(k);
      op->Start(c->GetIntoAsync(ns, v, dst, prefix));
    }
    return op;
  }

  // Starts storing blocks from `buffers` (as Put; over UCX when every
  // buffer lies in allocated or registered memory, else over gRPC, done
  // before this returns). The buffers must not change until the op is ready.
  std::unique_ptr<PyTransferOp> PutAsync(
      const std::string& ns, const std::vector<py::bytes>& keys,
      const py::sequence& buffers,
      const std::optional<std::vector<py::bytes>>& parents) {
    CheckPutCounts(keys, buffers, parents);
    std::vector<std::string> k = Keys(keys);
    ValidateNames(ns, k);
    std::vector<std::string> p = parents ? Keys(*parents) : std::vector<std::string>();
    std::vector<Memory> mem = GetMemories(buffers, /*writable=*/false, "buffers");
    // Keys and parents are copied into the request: they need to live only
    // through the call.
    std::vector<BlockToPut> blocks(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      blocks[i].key = k[i];
      if (!p.empty()) blocks[i].parent = p[i];
      blocks[i].bytes = absl::string_view(mem[i].data, mem[i].size);
    }
    std::shared_ptr<Client> c = client();
    auto op = std::make_unique<PyTransferOp>(c, std::move(mem));
    op->set_size(k.size());
    {
      py::gil_scoped_release release;
      op->Start(c->PutFromAsync(ns, blocks));
    }
    return op;
  }

  // Starts loading the blocks `keys` into the blocks `block_ids` of the
  // paged cache `caches` (of `layout`) through the staging `objects` (one
  // writable buffer of layout.object_bytes per block; over UCX when every
  // one lies in allocated or registered memory), in batches of
  // `batch_sizes` blocks (None: one batch), and returns a CacheLoad at once
  // (see CacheLoadState and PyCacheLoad). Bad input raises here, before
  // anything is read or written; per-block outcomes, misses included, are
  // the load's.
  std::unique_ptr<PyCacheLoad> LoadIntoCacheAsync(
      const std::string& ns, const std::vector<py::bytes>& keys,
      const py::sequence& objects, const KvLayout& layout, const py::sequence& caches,
      const std::vector<int64_t>& block_ids,
      const std::optional<std::vector<int64_t>>& batch_sizes) {
    const size_t n = keys.size();
    if (static_cast<size_t>(objects.size()) != n || block_ids.size() != n) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: ", n, " keys, ",
                                         objects.size(), " objects and ",
                                         block_ids.size(), " block ids"));
    }
    std::vector<std::string> k = Keys(keys);
    ValidateNames(ns, k);
    std::vector<size_t> bounds = {0};
    if (batch_sizes) {
      for (int64_t size : *batch_sizes) {
        if (size <= 0) {
          throw py::value_error("INVALID_ARGUMENT: batch sizes must be positive");
        }
        if (static_cast<uint64_t>(size) > n - bounds.back()) {  // no wrap-around
          throw py::value_error(absl::StrCat(
              "INVALID_ARGUMENT: batch sizes add up to more than ", n, " blocks"));
        }
        bounds.push_back(bounds.back() + static_cast<size_t>(size));
      }
      if (bounds.back() != n) {
        throw py::value_error(absl::StrCat("INVALID_ARGUMENT: batch sizes add up to ",
                                           bounds.back(), ", not ", n, " blocks"));
      }
    } else if (n > 0) {
      bounds.push_back(n);
    }
    std::vector<Memory> memory =
        GetMemories(caches, /*writable=*/true, "caches", /*with_shape=*/true);
    KvCacheView view = CacheView(layout, memory);
    for (size_t i = 0; i < n; ++i) {
      if (block_ids[i] < 0 || block_ids[i] >= view.num_blocks) {
        Raise(absl::OutOfRangeError(absl::StrCat("block id ", block_ids[i],
                                                 " is outside the cache's ",
                                                 view.num_blocks, " blocks")));
      }
    }
    std::vector<int64_t> sorted = block_ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      throw py::value_error("INVALID_ARGUMENT: block ids repeat");
    }
    std::vector<Memory> obj = GetMemories(objects, /*writable=*/true, "objects");
    CheckNoOverlap(obj, "objects");
    CheckObjectsApartFromCaches(obj, memory);
    std::vector<char*> dst;
    dst.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (obj[i].size != layout.object_bytes()) {
        throw py::value_error(absl::StrCat("INVALID_ARGUMENT: objects[", i, "] has ",
                                           obj[i].size, " bytes, expected ",
                                           layout.object_bytes()));
      }
      dst.push_back(obj[i].data);
    }
    for (Memory& m : obj) memory.push_back(std::move(m));
    std::shared_ptr<Client> c = client();
    auto state = std::make_shared<CacheLoadState>(*c, ns, std::move(k), std::move(dst),
                                                  layout, std::move(view), block_ids,
                                                  std::move(bounds));
    // The load owns the memory and the client before the loader can touch
    // them.
    auto load = std::make_unique<PyCacheLoad>(std::move(c), std::move(memory), state);
    load->Start();
    return load;
  }

  py::dict Evict(const std::string& ns, const std::vector<py::bytes>& keys, bool all) {
    std::vector<std::string> k = Keys(keys);
    return MessageToDict(Check(Released([&](Client& c) {
      std::vector<absl::string_view> v = Views(k);
      return c.Evict(ns, v, all);
    })));
  }

  py::dict Stats() {
    return MessageToDict(Check(Released([](Client& c) { return c.Stats(); })));
  }

  // A numpy uint8 array of `size` bytes allocated through UCX (shared
  // memory where UCX can): put and get_into with buffers inside it move
  // blocks over the UCX data plane. The memory stays valid while the array
  // or a view of it lives, past close() too (which closes the session all
  // the same), and goes back to the system when the last of them goes.
  py::array AllocateBuffer(size_t size) {
    // Taken while the GIL is held: a close() on another thread while the
    // allocation runs clears native_, and the memory must not go with it.
    std::shared_ptr<Client> native = native_;
    absl::Span<char> bytes =
        Check(Released([&](Client& client) { return client.AllocateBuffer(size); }));
    // Every view of the array (numpy slices, memoryviews, the objects an op
    // holds) keeps the capsule alive; once none is left, nothing in Python
    // reaches the memory and no op of ours uses it (ops hold their buffers
    // until they are ready), so it goes back (Client::FreeBuffer).
    struct Allocated {
      std::shared_ptr<Client> client;
      absl::Span<char> bytes;
      uint64_t born;  // see CountFork
    };
    auto* owner = new Allocated{std::move(native), bytes, born_};
    py::capsule keep(owner, [](void* p) {
      auto* allocated = static_cast<Allocated*>(p);
      WithoutGil([allocated] {
        if (allocated->born == Forks()) {  // not the parent's, from a child
          allocated->client->FreeBuffer(allocated->bytes).IgnoreError();
        }
        delete allocated;  // maybe the last reference to the client
      });
    });
    return py::array(py::dtype::of<uint8_t>(),
                     {static_cast<py::ssize_t>(bytes.size())}, {1},
                     bytes.data(), keep);
  }

  // Registers the memory of `buffer` (a writable C-contiguous buffer or CPU
  // tensor) with UCX, so that put and get_into with buffers inside it move
  // over the data plane, in place. The object is kept alive as long as the
  // native client (past close() while allocate_buffer arrays hold it).
  // Memory registered already (a view of an allocate_buffer array, or of a
  // registered object) is not registered again, and its object not kept:
  // a view of allocate_buffer memory holds the native client itself, so
  // the client keeping it would keep itself (its UCX workers, threads and
  // mappings) for good.
  void RegisterBuffer(const py::object& buffer) {
    std::shared_ptr<Client> c = client();
    Memory m = GetMemory(buffer, /*writable=*/true, "buffer");
    if (m.size > 0 && c->IsRegistered(m.data, m.size)) return;
    Check(Released([&](Client& client) {
      return client.RegisterBuffer(m.data, m.size);
    }));
    registered_->push_back(std::move(m));  // the GIL is held
  }

  // "" when blocks in allocated or registered buffers move over UCX;
  // otherwise why they take the gRPC byte path.
  std::string DataPlaneStatus() {
    absl::Status st = Released([](Client& c) {
      absl::Status s = c.EnsureSession().status();
      return s.ok() ? c.data_plane_status() : s;
    });
    return st.ok() ? "" : st.ToString();
  }

  // Closes the session (releasing its pins) once no call, op or load is in
  // flight (they hold client_), and the connection once no array of
  // allocate_buffer is left either; later calls raise RuntimeError.
  void Close() {
    std::shared_ptr<Client> c = std::move(client_);
    client_ = nullptr;
    std::shared_ptr<Client> native = std::move(native_);
    native_ = nullptr;
    py::gil_scoped_release release;
    c.reset();
    native.reset();
  }

  std::string server() const { return server_; }

 private:
  // Runs fn(client) with the GIL released and returns its result (absl
  // types only: no Python object is touched without the GIL).
  template <typename Fn>
  auto Released(Fn&& fn) -> decltype(fn(std::declval<Client&>())) {
    std::shared_ptr<Client> c = client();
    py::gil_scoped_release release;
    return fn(*c);
  }

  // The client, or raises once closed, and in a process forked since it
  // was made (CountFork). REQUIRES: the GIL.
  std::shared_ptr<Client> client() {
    if (born_ != Forks()) RaiseMadeBeforeFork("kvdepot.Client");
    if (client_ == nullptr) {
      throw std::runtime_error("FAILED_PRECONDITION: the client is closed");
    }
    return client_;
  }

  std::string server_;
  const uint64_t born_ = Forks();  // see CountFork
  // Both null once closed; changed only with the GIL held. client_ is
  // shared with the calls, ops and loads in flight, so that close() cannot
  // free the client under them, and closes the session when the last of
  // them lets go; native_ owns the client, shared with the arrays of
  // allocate_buffer (see the class comment).
  std::shared_ptr<Client> client_;
  std::shared_ptr<Client> native_;
  // Owned by native_'s deleter; valid while client_ is set. GIL held.
  std::vector<Memory>* registered_ = nullptr;
};

LayerRange Layers(const KvLayout& layout, std::optional<std::pair<int, int>> layers) {
  if (!layers) return layout.AllLayers();
  return LayerRange{layers->first, layers->second};
}

// The byte count each object buffer must have for `range`.
uint64_t PieceBytes(const KvLayout& layout, LayerRange range) {
  return static_cast<uint64_t>(range.end - range.begin) * layout.layer_bytes();
}

void CheckObjectSizes(const KvLayout& layout, LayerRange range,
                      const std::vector<Memory>& objects) {
  // Gather/Scatter check the range too; checked first here, so that the
  // object sizes are always checked.
  Check(ValidateLayerRange(layout, range));
  uint64_t want = PieceBytes(layout, range);
  for (size_t i = 0; i < objects.size(); ++i) {
    if (objects[i].size != want) {
      throw py::value_error(absl::StrCat("INVALID_ARGUMENT: objects[", i, "] has ",
                                         objects[i].size, " bytes, expected ", want));
    }
  }
}

void PyGather(const KvLayout& layout, const py::sequence& caches,
              const std::vector<int64_t>& block_ids, const py::sequence& objects,
              std::optional<std::pair<int, int>> layers) {
  std::vector<Memory> cache_mem =
      GetMemories(caches, /*writable=*/false, "caches", /*with_shape=*/true);
  std::vector<Memory> obj_mem = GetMemories(objects, /*writable=*/true, "objects");
  CheckNoOverlap(obj_mem, "objects");
  CheckObjectsApartFromCaches(obj_mem, cache_mem);
  KvCacheView view = CacheView(layout, cache_mem);
  LayerRange range = Layers(layout, layers);
  CheckObjectSizes(layout, range, obj_mem);
  std::vector<void*> dst;
  for (const Memory& m : obj_mem) dst.push_back(m.data);
  absl::Status st;
  {
    py::gil_scoped_release release;
    st = Gather(layout, view, block_ids, range, dst, StreamRef());
  }
  Check(st);
}

void PyScatter(const KvLayout& layout, const py::sequence& caches,
               const std::vector<int64_t>& block_ids, const py::sequence& objects,
               std::optional<std::pair<int, int>> layers) {
  std::vector<Memory> cache_mem =
      GetMemories(caches, /*writable=*/true, "caches", /*with_shape=*/true);
  std::vector<Memory> obj_mem = GetMemories(objects, /*writable=*/false, "objects");
  CheckObjectsApartFromCaches(obj_mem, cache_mem);
  KvCacheView view = CacheView(layout, cache_mem);
  LayerRange range = Layers(layout, layers);
  CheckObjectSizes(layout, range, obj_mem);
  std::vector<const void*> src;
  for (const Memory& m : obj_mem) src.push_back(m.data);
  absl::Status st;
  {
    py::gil_scoped_release release;
    st = Scatter(layout, view, block_ids, range, src, StreamRef());
  }
  Check(st);
}

}  // namespace
}  // namespace kvdepot

PYBIND11_MODULE(_kvdepot, m) {
  using namespace kvdepot;  // NOLINT: the binding names every type once.
  m.doc() = "Native binding of libkvdepot and the paged-KV gather/scatter "
            "(CPU). Use the `kvdepot` package instead of this module.";
  pthread_atfork(nullptr, nullptr, &CountFork);

  py::enum_<v1::Tier>(m, "Tier")
      .value("UNSPECIFIED", v1::TIER_UNSPECIFIED)
      .value("DRAM", v1::TIER_DRAM)
      .value("NVME", v1::TIER_NVME);

  py::class_<BlockInfo>(m, "BlockInfo", "One key's lookup result.")
      .def_readonly("found", &BlockInfo::found)
      .def_readonly("tier", &BlockInfo::tier)
      .def_readonly("size", &BlockInfo::size)
      .def_readonly("checksum", &BlockInfo::checksum)
      .def("__repr__", [](const BlockInfo& b) {
        return absl::StrCat("BlockInfo(found=", b.found ? "True" : "False",
                            ", tier=", v1::Tier_Name(b.tier), ", size=", b.size,
                            ", checksum=", b.checksum, ")");
      });

  py::class_<LookupReply>(m, "LookupReply", "The answer to Client.lookup.")
      .def_readonly("entries", &LookupReply::entries)
      .def_readonly("prefix_hits", &LookupReply::prefix_hits)
      .def_readonly("pin_id", &LookupReply::pin_id)
      .def("__repr__", [](const LookupReply& r) {
        return absl::StrCat("LookupReply(", r.entries.size(), " entries, prefix_hits=",
                            r.prefix_hits, ", pin_id=", r.pin_id, ")");
      });

  py::class_<PyTransferOp>(
      m, "TransferOp",
      "One get_into_async/put_async batch in flight. Holds the buffers and "
      "the client until it is seen ready; dropped earlier, it waits for the "
      "batch (GIL released). Result methods raise RuntimeError "
      "(FAILED_PRECONDITION) before it is ready.")
      .def("ready", &PyTransferOp::Ready, "True once every block has an outcome (never blocks).")
      .def("wait", &PyTransferOp::Wait, py::arg("timeout") = py::none(),
           "Waits until ready or `timeout` seconds (None: no limit; 0 polls), "
           "with the GIL released; returns whether it is ready.")
      .def("ok", &PyTransferOp::Ok,
           "One flag per block: True when filled (get) or stored (put, also "
           "when it already existed).")
      .def("errors", &PyTransferOp::Errors,
           "One entry per block: None when OK, else (code name, message), e.g. "
           "('NOT_FOUND', ...) for a miss.")
      .def("ok_prefix", &PyTransferOp::OkPrefix, "Number of leading blocks that are OK.")
      .def("already_stored", &PyTransferOp::AlreadyStored, py::arg("i"),
           "For a put: block i was stored before (its status is OK).")
      .def("transport", &PyTransferOp::Transport,
           "'ucx' or 'grpc': the path the blocks took ('none' when nothing "
           "was sent).")
      .def("__len__", &PyTransferOp::size)
      .def("__repr__", &PyTransferOp::Repr);

  py::enum_<KvDtype>(m, "KvDtype")
      .value("FLOAT16", KvDtype::kFloat16)
      .value("BFLOAT16", KvDtype::kBFloat16)
      .value("FLOAT8_E4M3", KvDtype::kFloat8E4M3)
      .value("FLOAT32", KvDtype::kFloat32);
  m.def("dtype_bytes", &KvDtypeBytes, py::arg("dtype"));
  m.def("dtype_name", [](KvDtype d) { return std::string(KvDtypeName(d)); },
        py::arg("dtype"));

  py::enum_<KvCacheLayout>(m, "KvCacheLayout")
      .value("FLASH_ATTN_NHD", KvCacheLayout::kFlashAttnNhd)
      .value("FLASH_ATTN_HND", KvCacheLayout::kFlashAttnHnd)
      .value("FLASH_INFER_NHD", KvCacheLayout::kFlashInferNhd)
      .value("FLASH_INFER_HND", KvCacheLayout::kFlashInferHnd)
      .value("MLA", KvCacheLayout::kMla)
      .value("CROSS_LAYER_NHD", KvCacheLayout::kCrossLayerNhd)
      .value("CROSS_LAYER_HND", KvCacheLayout::kCrossLayerHnd);

  py::class_<KvLayout>(m, "KvLayout",
                       "An engine's paged KV-cache layout (immutable).")
      .def_static(
          "create",
          [](KvCacheLayout layout, int num_layers, int num_components, int block_size,
             int num_kv_heads, int head_size, KvDtype dtype) {
            KvLayoutSpec spec;
            spec.layout = layout;
            spec.num_layers = num_layers;
            spec.num_components = num_components;
            spec.block_size = block_size;
            spec.num_kv_heads = num_kv_heads;
            spec.head_size = head_size;
            spec.dtype = dtype;
            return Check(KvLayout::Create(spec));
          },
          py::arg("layout"), py::arg("num_layers"), py::arg("num_components"),
          py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_size"),
          py::arg("dtype"))
      .def_static(
          "mha",
          [](KvCacheLayout layout, int num_layers, int block_size, int num_kv_heads,
             int head_size, KvDtype dtype) {
            return Check(KvLayout::Mha(layout, num_layers, block_size, num_kv_heads,
                                       head_size, dtype));
          },
          py::arg("layout"), py::arg("num_layers"), py::arg("block_size"),
          py::arg("num_kv_heads"), py::arg("head_size"), py::arg("dtype"))
      .def_static(
          "mla",
          [](KvCacheLayout layout, int num_layers, int block_size, int latent_size,
             KvDtype dtype) {
            return Check(
                KvLayout::Mla(layout, num_layers, block_size, latent_size, dtype));
          },
          py::arg("layout"), py::arg("num_layers"), py::arg("block_size"),
          py::arg("latent_size"), py::arg("dtype"))
      .def_property_readonly("layout", &KvLayout::layout)
      .def_property_readonly("num_layers", &KvLayout::num_layers)
      .def_property_readonly("num_components", &KvLayout::num_components)
      .def_property_readonly("block_size", &KvLayout::block_size)
      .def_property_readonly("num_kv_heads", &KvLayout::num_kv_heads)
      .def_property_readonly("head_size", &KvLayout::head_size)
      .def_property_readonly("dtype", &KvLayout::dtype)
      .def_property_readonly("cross_layer", &KvLayout::cross_layer)
      .def_property_readonly("num_tensors", &KvLayout::num_tensors)
      .def_property_readonly("element_bytes", &KvLayout::element_bytes)
      .def_property_readonly("layer_bytes", &KvLayout::layer_bytes)
      .def_property_readonly("object_bytes", &KvLayout::object_bytes)
      .def("tensor_bytes",
           [](const KvLayout& l, int64_t num_blocks) {
             return Check(l.TensorBytes(num_blocks));
           },
           py::arg("num_blocks"))
      .def_property_readonly("object_format", &KvLayout::ObjectFormat)
      .def_property_readonly("fingerprint", &KvLayout::Fingerprint)
      .def("namespace_for",
           [](const KvLayout& l, const std::string& model) {
             return Check(l.NamespaceFor(model));
           },
           py::arg("model"))
      .def("__repr__", &KvLayout::DebugString);

  py::class_<PyCacheLoad>(
      m, "CacheLoad",
      "A Client.load_into_cache_async in flight: blocks read into staging "
      "objects and scattered into a paged cache by a loader thread, layer by "
      "layer, layers ready in order. Holds the caches, objects and client "
      "until seen done; dropped earlier, it scatters no further layer and "
      "waits for the batches in flight (GIL released). ok()/errors() raise "
      "RuntimeError (FAILED_PRECONDITION) before it is done.")
      .def("ready_layers", &PyCacheLoad::ReadyLayers,
           "n: layers [0, n) of every loaded block are in the cache (never "
           "blocks). num_layers once done, unless a scatter failed: then "
           "below the layer that failed.")
      .def("ready", &PyCacheLoad::Ready,
           "True once every block has an outcome and every hit is scattered "
           "(never blocks).")
      .def("wait_for_layer", &PyCacheLoad::WaitForLayer, py::arg("layer"),
           py::arg("timeout") = py::none(),
           "Waits until layers [0, layer] are in the cache or `timeout` seconds "
           "(None: no limit; 0 polls), with the GIL released; returns whether "
           "they are. ValueError for a layer outside [0, num_layers). Raises "
           "the error of a failed scatter (RuntimeError, or ValueError for "
           "INVALID_ARGUMENT / OUT_OF_RANGE) once the load is done, when that "
           "layer or an earlier one failed: the blocks hold some layers only.")
      .def("wait", &PyCacheLoad::Wait, py::arg("timeout") = py::none(),
           "Waits until ready or `timeout` seconds (None: no limit; 0 polls), "
           "with the GIL released; returns whether it is ready.")
      .def("ok", &PyCacheLoad::Ok, "One flag per block: True when loaded.")
      .def("errors", &PyCacheLoad::Errors,
           "One entry per block: None when loaded, else (code name, message), "
           "e.g. ('NOT_FOUND', ...) for a miss (its cache block untouched).")
      .def_property_readonly("num_layers", &PyCacheLoad::num_layers)
      .def("__len__", &PyCacheLoad::size)
      .def("__repr__", &PyCacheLoad::Repr);

  py::class_<PyClient>(m, "Client",
                       "A connection to kvdepotd (thread-safe). No RPC is made "
                       "until the first call.")
      .def(py::init<const std::string&, double, double, const std::string&>(),
           py::arg("server") = "127.0.0.1:50551", py::arg("timeout_s") = 30.0,
           py::arg("lease_s") = 0.0, py::arg("client_name") = "kvdepot-python")
      .def_property_readonly("server", &PyClient::server)
      .def("close", &PyClient::Close,
           "Closes the session (releasing its pins) and the connection.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyClient& c, py::object, py::object, py::object) { c.Close(); })
      .def("health", &PyClient::Health,
           "Raises RuntimeError (UNAVAILABLE) unless the daemon is serving.")
      .def("ensure_session", &PyClient::EnsureSession,
           "Opens a session if none is open (kept alive in the background); "
           "returns its id.")
      .def("close_session", &PyClient::CloseSession,
           "Closes the session, releasing its pins.")
      .def("lookup", &PyClient::Lookup, py::arg("ns"), py::arg("keys"),
           py::arg("prefix") = false, py::arg("pin") = false)
      .def("unpin", &PyClient::Unpin, py::arg("pin_id"))
      .def("put", &PyClient::Put, py::arg("ns"), py::arg("keys"), py::arg("buffers"),
           py::arg("parents") = py::none(),
           "Stores blocks (put-if-absent) straight from the buffers; returns "
           "True per block stored, False where it already existed.")
      .def("get_into", &PyClient::GetInto, py::arg("ns"), py::arg("keys"),
           py::arg("buffers"),
           "Reads blocks into writable buffers of exactly the block size; "
           "returns True per block filled, False per miss (buffer untouched).")
      .def("get_into_async", &PyClient::GetIntoAsync, py::arg("ns"), py::arg("keys"),
           py::arg("buffers"), py::arg("prefix") = false,
           "Starts reading blocks into writable buffers of exactly the block "
           "size; returns a TransferOp (a miss is a NOT_FOUND block status, "
           "its buffer untouched). Over UCX when every buffer lies in "
           "allocate_buffer/register_buffer memory, else over gRPC, done "
           "before this returns. With prefix, stops at the first miss.")
      .def("put_async", &PyClient::PutAsync, py::arg("ns"), py::arg("keys"),
           py::arg("buffers"), py::arg("parents") = py::none(),
           "Starts storing blocks (put-if-absent) from the buffers; returns a "
           "TransferOp (ok per block stored; already_stored(i) where it "
           "existed). The buffers must not change until the op is ready.")
      .def("load_into_cache_async", &PyClient::LoadIntoCacheAsync, py::arg("ns"),
           py::arg("keys"), py::arg("objects"), py::arg("layout"), py::arg("caches"),
           py::arg("block_ids"), py::arg("batch_sizes") = py::none(),
           "Starts loading blocks into a paged cache: keys[i] is read into "
           "objects[i] (staging, layout.object_bytes each) and scattered into "
           "block block_ids[i] of caches, in batches of batch_sizes blocks "
           "(None: one batch), by a loader thread; returns a CacheLoad at "
           "once. Bad input (counts, names, sizes, block ids out of range or "
           "repeated) raises before anything moves. A miss is a NOT_FOUND "
           "block, its cache block untouched.")
      .def("allocate_buffer", &PyClient::AllocateBuffer, py::arg("size"),
           "A numpy uint8 array allocated and registered through UCX; put "
           "and get_into with buffers inside it use the UCX data plane "
           "(shared memory with a daemon on this host). Its pages exist "
           "when it returns (it takes time in proportion to size).")
      .def("register_buffer", &PyClient::RegisterBuffer, py::arg("buffer"),
           "Registers a writable buffer (numpy array, bytearray, CPU tensor) "
           "with UCX: put and get_into with buffers inside it use the UCX "
           "data plane without copies. The object is kept alive as long as "
           "the client.")
      .def("data_plane_status", &PyClient::DataPlaneStatus,
           "'' when the UCX data plane is in use, else why not (opens a "
           "session to find out).")
      .def("evict", &PyClient::Evict, py::arg("ns"), py::arg("keys") =
           std::vector<py::bytes>(), py::arg("all") = false)
      .def("stats", &PyClient::Stats);

  m.def("gather", &PyGather, py::arg("layout"), py::arg("caches"),
        py::arg("block_ids"), py::arg("objects"), py::arg("layers") = py::none(),
        "Copies blocks out of a paged cache into one object buffer per block "
        "(CPU twin).");
  m.def("scatter", &PyScatter, py::arg("layout"), py::arg("caches"),
        py::arg("block_ids"), py::arg("objects"), py::arg("layers") = py::none(),
        "Writes one object buffer per block into a paged cache (CPU twin).");
}
