// CUDA graphs of libtorch work (at::cuda::CUDAGraph, what torch.cuda.graph wraps): a forward
// recorded once and replayed with one launch, its allocations in the graph's private memory pool.
// Built as a library of its own that links libtorch_cuda, loaded only when a graph is asked for
// (kernels/src/cuda_graph.rs), so binaries without CUDA still start.
//
// Capture cannot use the legacy default stream libtorch otherwise runs on: `enter` makes a side
// stream current (after the work queued so far) and hands its handle out for the kernels launched
// outside libtorch; `exit` makes the old stream current again, after the side stream's work.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <cstdio>
#include <exception>
#include <optional>

namespace {
struct Graph : at::cuda::CUDAGraph {
  std::optional<c10::cuda::CUDAStream> outer;

  // A capture that fails ends before CUDAGraph hands the generators it put in capture mode back:
  // left so, each would refuse every later random draw ("Offset increment outside graph
  // capture"). This is what their capture epilogue does.
  void release_generators() {
    for (auto& entry : captured_generator_states_) {
      entry.first->capturing_ = false;
    }
  }
};

// `waiter` waits for the work queued on `first` so far.
void after(const c10::cuda::CUDAStream& first, const c10::cuda::CUDAStream& waiter) {
  cudaEvent_t queued;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(queued, first.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), queued, 0));
  C10_CUDA_CHECK(cudaEventDestroy(queued));
}

int fail(const std::exception& e, char* err, size_t err_len) {
  std::snprintf(err, err_len, "%s", e.what());
  return 1;
}
}  // namespace

extern "C" int dflash_graph_new(void** out, char* err, size_t err_len) {
  try {
    *out = new Graph();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, err_len);
  }
}

extern "C" void dflash_graph_free(void* g) { delete static_cast<Graph*>(g); }

extern "C" int dflash_graph_enter(void* g, int device, void** stream, char* err, size_t err_len) {
  try {
    auto* graph = static_cast<Graph*>(g);
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    auto outer = c10::cuda::getCurrentCUDAStream(device);
    auto side = c10::cuda::getStreamFromPool(false, device);
    after(outer, side);
    c10::cuda::setCurrentCUDAStream(side);
    graph->outer = outer;
    *stream = side.stream();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, err_len);
  }
}

extern "C" int dflash_graph_exit(void* g, char* err, size_t err_len) {
  try {
    auto* graph = static_cast<Graph*>(g);
    if (!graph->outer) {
      return 0;
    }
    auto side = c10::cuda::getCurrentCUDAStream();
    after(side, *graph->outer);
    c10::cuda::setCurrentCUDAStream(*graph->outer);
    graph->outer.reset();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, err_len);
  }
}

// Thread-local capture: another thread's CUDA calls do not invalidate it.
extern "C" int dflash_graph_capture_begin(void* g, char* err, size_t err_len) {
  try {
    static_cast<Graph*>(g)->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, err_len);
  }
}

extern "C" int dflash_graph_capture_end(void* g, char* err, size_t err_len) {
  auto* graph = static_cast<Graph*>(g);
  try {
    graph->capture_end();
    return 0;
  } catch (const std::exception& e) {
    graph->release_generators();
    return fail(e, err, err_len);
  }
}

extern "C" int dflash_graph_replay(void* g, char* err, size_t err_len) {
  try {
    static_cast<Graph*>(g)->replay();
    return 0;
  } catch (const std::exception& e) {
    return fail(e, err, err_len);
  }
}
