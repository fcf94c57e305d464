// How tensors cross into rapo_fast._C: each tensor argument of an entry point is a DLPack capsule
// (torch.utils.dlpack.to_dlpack(t), t.__dlpack__()) or an object with __dlpack__, read through the official header
// (csrc/third_party/dlpack/dlpack.h) into a TensorArg, and checked there, next to the pointer it yields: rank, shape,
// dtype, device, strides, writability. A failed check raises TypeError (not a tensor, wrong dtype) or ValueError
// (shape, device, layout) naming the entry point, the argument, what it expected and what it got. Also the scalar
// integer arguments (int_arg: a TypeError naming an int that does not fit). Only the *_bindings.cpp files include this.
// Not here: the extent and index checks the backends run themselves (rapo/retrieval.h, rapo/kv_splice.h).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "dlpack/dlpack.h"
#include "rapo/constants.h"  // DType

namespace rapo {

inline std::string dl_dtype_name(DLDataType t) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return "float32";
    if (t.code == kDLFloat && t.bits == 16) return "float16";
    if (t.code == kDLBfloat && t.bits == 16) return "bfloat16";
    if (t.code == kDLFloat && t.bits == 64) return "float64";
    if (t.code == kDLInt && t.bits == 64) return "int64";
    if (t.code == kDLInt && t.bits == 32) return "int32";
    if (t.code == kDLInt && t.bits == 16) return "int16";
    if (t.code == kDLInt && t.bits == 8) return "int8";
    if (t.code == kDLUInt && t.bits == 8) return "uint8";
    if (t.code == kDLBool && t.bits == 8) return "bool";
  }
  return "DLPack dtype (code " + std::to_string(t.code) + ", bits " + std::to_string(t.bits) + ", lanes " +
         std::to_string(t.lanes) + ")";
}

// The DLPack dtype of each DType code the backends read.
inline DLDataType dl_dtype_of(DType d) {
  switch (d) {
    case DType::F32: return {kDLFloat, 32, 1};
    case DType::F16: return {kDLFloat, 16, 1};
    case DType::BF16: return {kDLBfloat, 16, 1};
    case DType::I64: return {kDLInt, 64, 1};
    case DType::I32: return {kDLInt, 32, 1};
    case DType::U8: return {kDLUInt, 8, 1};
    default: return {kDLBool, 8, 1};
  }
}

inline bool dl_same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

inline std::string dl_device_name(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cpu (cuda pinned)";
    case kDLCUDAManaged: return "cuda managed memory";
    default: return "DLPack device type " + std::to_string(int(d.device_type)) + ":" + std::to_string(d.device_id);
  }
}

// The Python type name of an argument, for messages.
inline std::string py_type_name(pybind11::handle h) { return Py_TYPE(h.ptr())->tp_name; }

// A scalar integer argument as T: a TypeError naming it when it is not an int (a float would truncate) or does not
// fit T (pybind11 would say only "incompatible function arguments").
template <class T>
T int_arg(pybind11::handle v, const char* op, const char* name) {
  const std::string where = std::string(op) + ": " + name;
  if (PyFloat_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
    throw pybind11::type_error(where + ": expected an int, got " + py_type_name(v));
  pybind11::object i = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(v.ptr()));
  if (!i) throw pybind11::error_already_set();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0 || x < static_cast<long long>(std::numeric_limits<T>::min()) ||
      x > static_cast<long long>(std::numeric_limits<T>::max()))
    throw pybind11::type_error(where + ": expected an int that fits " + (sizeof(T) == 8 ? "int64" : "int32") +
                               ", got " + std::string(pybind11::str(i)));
  return static_cast<T>(x);
}

// One tensor argument, borrowed for the call: the DLManagedTensor of a consumed capsule (renamed "used_dltensor" /
// "used_dltensor_versioned" as the DLPack Python spec asks; its deleter runs when the TensorArg goes, with the GIL
// held), or none (an optional argument given None). The Python caller keeps the tensor alive while a CUDA kernel
// reads it, as for any asynchronous torch op. The check methods return *this so that they chain.
class TensorArg {
 public:
  TensorArg() = default;
  TensorArg(pybind11::handle obj, const char* op, std::string name, bool optional = false)
      : op_(op), name_(std::move(name)) {
    if (obj.is_none()) {
      if (optional) return;
      throw pybind11::type_error(where() + ": expected a tensor, got None");
    }
    pybind11::object cap = pybind11::reinterpret_borrow<pybind11::object>(obj);
    if (!PyCapsule_CheckExact(obj.ptr())) {
      if (!pybind11::hasattr(obj, "__dlpack__"))
        throw pybind11::type_error(
            where() + ": expected a tensor (a DLPack capsule or an object with __dlpack__), got " + py_type_name(obj));
      cap = obj.attr("__dlpack__")();
    }
    consume(cap);
  }
  TensorArg(TensorArg&& o) noexcept { *this = std::move(o); }
  TensorArg& operator=(TensorArg&& o) noexcept {
    if (this != &o) {
      release();
      std::swap(op_, o.op_), std::swap(name_, o.name_), std::swap(t_, o.t_), std::swap(read_only_, o.read_only_);
      std::swap(legacy_, o.legacy_), std::swap(versioned_, o.versioned_);
    }
    return *this;
  }
  TensorArg(const TensorArg&) = delete;
  TensorArg& operator=(const TensorArg&) = delete;
  ~TensorArg() { release(); }

  bool given() const { return t_ != nullptr; }
  const std::string& name() const { return name_; }
  int ndim() const { return t_->ndim; }
  int64_t size(int d) const { return t_->shape[d]; }
  // Elements; a producer may omit strides (NULL) for a compact row-major tensor.
  int64_t stride(int d) const {
    if (t_->strides != nullptr) return t_->strides[d];
    int64_t s = 1;
    for (int i = t_->ndim - 1; i > d; --i) s *= t_->shape[i];
    return s;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < t_->ndim; ++d) n *= t_->shape[d];
    return n;
  }
  DLDevice device() const { return t_->device; }
  DLDataType dtype() const { return t_->dtype; }
  // The first element, or nullptr for an empty (or absent) tensor: the backends read no element of those.
  template <class T = void>
  T* data() const {
    if (t_ == nullptr || numel() == 0) return nullptr;
    return reinterpret_cast<T*>(static_cast<char*>(t_->data) + t_->byte_offset);
  }
  std::string shape_str() const {
    std::string s = "[";
    for (int d = 0; d < t_->ndim; ++d) s += (d ? ", " : "") + std::to_string(t_->shape[d]);
    return s + "]";
  }
  std::string strides_str() const {
    std::string s = "[";
    for (int d = 0; d < t_->ndim; ++d) s += (d ? ", " : "") + std::to_string(stride(d));
    return s + "]";
  }

  TensorArg& dims(int n, const char* layout) {
    if (t_->ndim != n)
      throw pybind11::value_error(where() + ": expected " + std::to_string(n) + "-d " + layout + ", got shape " +
                                  shape_str());
    return *this;
  }
  TensorArg& dtype(DType want) {
    if (!dl_same_dtype(t_->dtype, dl_dtype_of(want)))
      throw pybind11::type_error(where() + ": expected " + dl_dtype_name(dl_dtype_of(want)) + ", got " +
                                 dl_dtype_name(t_->dtype));
    return *this;
  }
  // float32, float16 or bfloat16; returns its DType code.
  DType float_dtype() const {
    for (DType d : {DType::F32, DType::F16, DType::BF16})
      if (dl_same_dtype(t_->dtype, dl_dtype_of(d))) return d;
    throw pybind11::type_error(where() + ": expected float32, float16 or bfloat16, got " + dl_dtype_name(t_->dtype));
  }
  TensorArg& same_dtype(const TensorArg& o) {
    if (!dl_same_dtype(t_->dtype, o.t_->dtype))
      throw pybind11::type_error(where() + ": expected the dtype of " + o.name_ + " (" + dl_dtype_name(o.t_->dtype) +
                                 "), got " + dl_dtype_name(t_->dtype));
    return *this;
  }
  TensorArg& size_is(int d, int64_t want, const std::string& what) {
    if (t_->shape[d] != want)
      throw pybind11::value_error(where() + ": expected " + what + " = " + std::to_string(want) + " in dim " +
                                  std::to_string(d) + ", got shape " + shape_str());
    return *this;
  }
  TensorArg& same_shape(const TensorArg& o) {
    bool same = t_->ndim == o.t_->ndim;
    for (int d = 0; same && d < t_->ndim; ++d) same = t_->shape[d] == o.t_->shape[d];
    if (!same)
      throw pybind11::value_error(where() + ": expected the shape of " + o.name_ + " (" + o.shape_str() + "), got " +
                                  shape_str());
    return *this;
  }
  TensorArg& same_strides(const TensorArg& o) {
    bool same = t_->ndim == o.t_->ndim;
    for (int d = 0; same && d < t_->ndim; ++d) same = t_->shape[d] <= 1 || stride(d) == o.stride(d);
    if (!same)
      throw pybind11::value_error(where() + ": expected the strides of " + o.name_ + " (" + o.strides_str() +
                                  "), got " + strides_str());
    return *this;
  }
  TensorArg& on(DLDevice want) {
    const DLDevice d = t_->device;
    if (d.device_type != want.device_type || (want.device_type == kDLCUDA && d.device_id != want.device_id))
      throw pybind11::value_error(where() + ": expected device " + dl_device_name(want) + ", got " + dl_device_name(d));
    return *this;
  }
  // Readable on the host: CPU memory or pinned host memory.
  TensorArg& on_host() {
    const auto t = t_->device.device_type;
    if (t != kDLCPU && t != kDLCUDAHost)
      throw pybind11::value_error(where() + ": expected host memory (cpu), got " + dl_device_name(t_->device));
    return *this;
  }
  // Row-major and dense (strides of size-1 dimensions are not read).
  TensorArg& contiguous() {
    int64_t want = 1;
    for (int d = t_->ndim - 1; d >= 0; --d) {
      if (t_->shape[d] != 1 && stride(d) != want)
        throw pybind11::value_error(where() + ": expected a contiguous (row-major) tensor, got shape " + shape_str() +
                                    " with strides " + strides_str());
      want *= t_->shape[d];
    }
    return *this;
  }
  // The last dimension contiguous (stride 1), the others as they are.
  TensorArg& unit_inner_stride() {
    const int d = t_->ndim - 1;
    if (t_->shape[d] > 1 && stride(d) != 1)
      throw pybind11::value_error(where() + ": expected a contiguous last dimension (stride 1), got strides " +
                                  strides_str());
    return *this;
  }
  TensorArg& writable() {
    if (read_only_)
      throw pybind11::value_error(where() +
                                  ": expected a writable tensor (it is written to), got one exported read-only");
    return *this;
  }

 private:
  std::string where() const { return std::string(op_) + ": " + name_; }

  void consume(const pybind11::object& cap) {
    PyObject* c = cap.ptr();
    const char* cname = PyCapsule_GetName(c);
    if (cname == nullptr) throw pybind11::error_already_set();
    const std::string n(cname);
    if (n == "dltensor") {
      legacy_ = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, cname));
      if (legacy_ == nullptr) throw pybind11::error_already_set();
      if (PyCapsule_SetName(c, "used_dltensor") != 0) {
        legacy_ = nullptr;
        throw pybind11::error_already_set();
      }
      t_ = &legacy_->dl_tensor;
    } else if (n == "dltensor_versioned") {
      versioned_ = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, cname));
      if (versioned_ == nullptr) throw pybind11::error_already_set();
      if (PyCapsule_SetName(c, "used_dltensor_versioned") != 0) {
        versioned_ = nullptr;
        throw pybind11::error_already_set();
      }
      // Another major version may lay the struct out differently: only its deleter may be called (release()).
      if (versioned_->version.major != DLPACK_MAJOR_VERSION) {
        const std::string msg = where() + ": expected DLPack major version " + std::to_string(DLPACK_MAJOR_VERSION) +
                                " (this build's), got " + std::to_string(versioned_->version.major);
        release();  // thrown from the constructor: the destructor will not run
        throw pybind11::value_error(msg);
      }
      read_only_ = (versioned_->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
      t_ = &versioned_->dl_tensor;
    } else if (n == "used_dltensor" || n == "used_dltensor_versioned") {
      throw pybind11::value_error(where() +
                                  ": expected a fresh DLPack capsule (one per call), got one consumed already");
    } else {
      throw pybind11::type_error(where() + ": expected a DLPack capsule, got a capsule named \"" + n + "\"");
    }
  }

  void release() {
    if (legacy_ != nullptr && legacy_->deleter != nullptr) legacy_->deleter(legacy_);
    if (versioned_ != nullptr && versioned_->deleter != nullptr) versioned_->deleter(versioned_);
    legacy_ = nullptr, versioned_ = nullptr, t_ = nullptr;
  }

  const char* op_ = "";
  std::string name_;
  DLTensor* t_ = nullptr;
  DLManagedTensor* legacy_ = nullptr;
  DLManagedTensorVersioned* versioned_ = nullptr;
  bool read_only_ = false;
};

}  // namespace rapo
