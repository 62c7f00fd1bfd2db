// The CUDA caching allocator's statistics (what torch.cuda.max_memory_allocated reads), which tch
// does not bind: bytes allocated now and at the peak since the last reset, bytes reserved. Only
// through c10's DeviceAllocator interface, so nothing here links the CUDA libraries; on a build or
// a process without CUDA the call returns an error instead.
#include <c10/core/CachingDeviceAllocator.h>
#include <cstdio>
#include <exception>

extern "C" int dflash_cuda_memory_stats(int device, int reset_peak, int64_t* allocated, int64_t* peak,
                                        int64_t* reserved, char* err, size_t err_len) {
  try {
    auto* a = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    auto stats = a->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[all].current;
    *peak = stats.allocated_bytes[all].peak;
    *reserved = stats.reserved_bytes[all].current;
    if (reset_peak) {
      a->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    }
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
