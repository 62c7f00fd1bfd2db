// The NCCL process group, in a library of its own: it needs libtorch_cuda.so (and through it
// libnccl), which a machine without CUDA cannot load. The host loads this library only when a
// run's device is CUDA, makes the backend here, and runs collectives through c10d.cpp's calls on
// the c10d::Backend it gets back.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdio>
#include <exception>

extern "C" {

// `store` is a reference released from an intrusive_ptr<c10d::Store> (dflash_c10d_store_raw),
// taken over here; `*backend` a reference released from the new group's intrusive_ptr.
int dflash_c10d_nccl_new(void* store, const char* prefix, int rank, int world, int64_t timeout_ms, void** backend,
                         char* err, size_t err_len) {
  auto s = c10::intrusive_ptr<c10d::Store>::reclaim(static_cast<c10d::Store*>(store));
  try {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, s);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, world, opts);
    *backend = c10::intrusive_ptr<c10d::Backend>(pg).release();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

// NCCL's version as libtorch_cuda sees it ("2.28.9"), for logs and reports.
int dflash_c10d_nccl_version(char* out, size_t len) {
  std::snprintf(out, len, "%s", c10d::getNcclVersion().c_str());
  return 0;
}

}  // extern "C"
