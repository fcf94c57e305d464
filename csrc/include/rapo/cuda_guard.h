// CUDA error checking and the current-device guard shared by the CUDA backends (csrc/retrieval_cuda.cu,
// csrc/kv_splice_cuda.cu): every CUDA runtime call's status is checked and turned into a std::runtime_error that
// names the op and the call (pybind11 raises it in Python as RuntimeError).
// Not a place for kernels or launch logic; host code only.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace rapo {

// Throws "<op>: <what>: <CUDA error string>" unless e is cudaSuccess.
inline void cuda_check(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(op) + ": " + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the guard's lifetime (a launch on torch's stream must run on the stream's device) and
// makes the previous device current again. Call restore() at the end of the normal path so that a failure to restore
// is reported; on an exception path the destructor restores without checking (an error is already on its way).
class CudaDeviceGuard {
 public:
  CudaDeviceGuard(int device, const char* op) : op_(op) {
    cuda_check(cudaGetDevice(&prev_), op_, "cudaGetDevice");
    if (prev_ != device) {
      cuda_check(cudaSetDevice(device), op_, "cudaSetDevice");
      switched_ = true;
    }
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

  void restore() {
    if (!switched_) return;
    switched_ = false;
    cuda_check(cudaSetDevice(prev_), op_, "cudaSetDevice (restoring the previous device)");
  }

  ~CudaDeviceGuard() {
    if (switched_) (void)cudaSetDevice(prev_);
  }

 private:
  const char* op_;
  int prev_ = -1;
  bool switched_ = false;
};

}  // namespace rapo
