// libtorch's Kineto profiler (what torch.profiler drives from Python), which tch does not bind:
// start, named ranges, stop and save a Chrome trace. Errors come back as text.
#include <cstdlib>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <cstdio>
#include <exception>
#include <set>

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

extern "C" int dflash_profiler_start(int cuda, char* err, size_t err_len) {
  try {
    // A CPU-only trace: Kineto would still ask the CUDA runtime for devices and log an ERROR line
    // ("gpuGetDeviceCount failed") on a machine without a driver. Quiet it unless the user chose
    // a level.
    if (!cuda) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
    impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
    if (cuda) activities.insert(impl::ActivityType::CUDA);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities, {at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE});
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

extern "C" int dflash_profiler_stop(const char* path, char* err, size_t err_len) {
  try {
    auto result = prof::disableProfiler();
    if (path) result->save(path);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

// A named range in the trace (like torch.profiler.record_function): begin returns the open
// record, end closes and frees it.
extern "C" void* dflash_range_begin(const char* name) {
  auto* record = new at::RecordFunction(at::RecordScope::USER_SCOPE);
  if (record->isActive()) record->before(std::string_view(name));
  return record;
}

extern "C" void dflash_range_end(void* record) {
  delete static_cast<at::RecordFunction*>(record);  // the destructor runs the end callbacks
}
