// torch::autograd::backward with gradients for several outputs at once, which tch does not bind
// (its backward takes none): one pass of the engine, no sum(y * g) graph built for the purpose.
#include <torch/csrc/autograd/autograd.h>
#include <cstdio>
#include <exception>
#include <vector>

extern "C" int dflash_backward(const at::Tensor* const* tensors, const at::Tensor* const* grads, size_t n, char* err,
                               size_t err_len) {
  try {
    std::vector<at::Tensor> ts, gs;
    for (size_t i = 0; i < n; ++i) {
      ts.push_back(*tensors[i]);
      gs.push_back(*grads[i]);
    }
    torch::autograd::backward(ts, gs);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

// Drop a tensor's gradient (PyTorch's zero_grad(set_to_none=True)): its memory goes back to the
// allocator until the next backward makes a new one.
extern "C" void dflash_clear_grad(const at::Tensor* t) {
  t->mutable_grad() = at::Tensor();
}

// An uninitialised CPU tensor shaped and typed as `t` (on any device), in pinned (page-locked)
// memory from libtorch's caching host allocator, so copies between it and a GPU can be
// asynchronous. Filling it is the caller's: a buffer about to be overwritten needs no copy, where
// `pin_memory()` on an empty tensor copies its garbage.
extern "C" int dflash_empty_pinned_like(const at::Tensor* t, at::Tensor** out, char* err, size_t err_len) {
  try {
    *out = new at::Tensor(t->new_empty(t->sizes(), t->options().device(at::kCPU).pinned_memory(true)));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
