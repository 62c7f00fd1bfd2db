// libtorch's c10d for the host: the TCPStore rendezvous, a Gloo process group, and collectives
// on any c10d::Backend (Gloo here, NCCL from c10d_nccl.cpp). Only libtorch_cpu symbols, so it
// links into every binary; the NCCL backend lives in a library of its own, loaded with CUDA.
// Handles cross as opaque pointers, tensors as tch's at::Tensor*, errors as text.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

struct DflashStore {
  c10::intrusive_ptr<c10d::Store> store;
};

struct DflashGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
};

static int fail(const std::exception& e, char* err, size_t err_len) {
  std::snprintf(err, err_len, "%s", e.what());
  return 1;
}

#define GUARD_BEGIN try {
#define GUARD_END                  \
  return 0;                        \
  }                                \
  catch (const std::exception& e) { \
    return fail(e, err, err_len);  \
  }

extern "C" {

// A TCPStore client of the store at host:port; with `listen_fd` >= 0 (rank 0) it also serves the
// store on that socket, which the caller bound and listens on (so it chooses the address: c10d's
// own server would listen on every interface) and which the server takes over. Connecting
// retries until `timeout_ms`.
int dflash_c10d_store_new(const char* host, uint16_t port, int listen_fd, int64_t timeout_ms, DflashStore** out,
                          char* err, size_t err_len) {
  GUARD_BEGIN
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = listen_fd >= 0;
  if (listen_fd >= 0) opts.masterListenFd = listen_fd;
  opts.waitWorkers = false;  // we wait for the ranks ourselves, to name the one missing
  opts.timeout = std::chrono::milliseconds(timeout_ms);
  *out = new DflashStore{c10::make_intrusive<c10d::TCPStore>(host, opts)};
  GUARD_END
}

void dflash_c10d_store_free(DflashStore* s) { delete s; }

int dflash_c10d_store_set(DflashStore* s, const char* key, const uint8_t* data, size_t n, char* err, size_t err_len) {
  GUARD_BEGIN
  s->store->set(key, std::vector<uint8_t>(data, data + n));
  GUARD_END
}

// The value of `key` (waits for it up to the store's timeout), malloc'ed; free with
// dflash_c10d_bytes_free.
int dflash_c10d_store_get(DflashStore* s, const char* key, uint8_t** data, size_t* n, char* err, size_t err_len) {
  GUARD_BEGIN
  auto v = s->store->get(key);
  *n = v.size();
  *data = static_cast<uint8_t*>(std::malloc(v.size() ? v.size() : 1));
  std::memcpy(*data, v.data(), v.size());
  GUARD_END
}

void dflash_c10d_bytes_free(uint8_t* data) { std::free(data); }

int dflash_c10d_store_check(DflashStore* s, const char* key, bool* present, char* err, size_t err_len) {
  GUARD_BEGIN
  *present = s->store->check({std::string(key)});
  GUARD_END
}

// Set `key` to `desired` if it holds `expected` (an empty `expected`: if it is unset); the value
// it holds afterwards, malloc'ed (free with dflash_c10d_bytes_free).
int dflash_c10d_store_compare_set(DflashStore* s, const char* key, const uint8_t* expected, size_t n_expected,
                                  const uint8_t* desired, size_t n_desired, uint8_t** data, size_t* n, char* err,
                                  size_t err_len) {
  GUARD_BEGIN
  auto v = s->store->compareSet(key, std::vector<uint8_t>(expected, expected + n_expected),
                                std::vector<uint8_t>(desired, desired + n_desired));
  *n = v.size();
  *data = static_cast<uint8_t*>(std::malloc(v.size() ? v.size() : 1));
  std::memcpy(*data, v.data(), v.size());
  GUARD_END
}

int dflash_c10d_store_add(DflashStore* s, const char* key, int64_t value, int64_t* now, char* err, size_t err_len) {
  GUARD_BEGIN
  *now = s->store->add(key, value);
  GUARD_END
}

// Remove `key`; `removed` says whether it was set.
int dflash_c10d_store_delete(DflashStore* s, const char* key, bool* removed, char* err, size_t err_len) {
  GUARD_BEGIN
  *removed = s->store->deleteKey(key);
  GUARD_END
}

// How many keys the store holds (the server's count, every client's keys together).
int dflash_c10d_store_num_keys(DflashStore* s, int64_t* n, char* err, size_t err_len) {
  GUARD_BEGIN
  *n = s->store->getNumKeys();
  GUARD_END
}

// The store as c10d sees it (a new reference), for the NCCL library's constructor.
void* dflash_c10d_store_raw(DflashStore* s) {
  return c10::intrusive_ptr<c10d::Store>(s->store).release();
}

// Gloo over the store's rendezvous (keys under `prefix`). Its device: GLOO_SOCKET_IFNAME's
// interfaces when set, else this host's name or the loopback (as torch.distributed does).
int dflash_c10d_gloo_new(DflashStore* s, const char* prefix, int rank, int world, int64_t timeout_ms, DflashGroup** out,
                         char* err, size_t err_len) {
  GUARD_BEGIN
  auto timeout = std::chrono::milliseconds(timeout_ms);
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
    std::string all(ifnames);
    size_t start = 0;
    while (start <= all.size()) {
      size_t end = all.find(',', start);
      if (end == std::string::npos) end = all.size();
      if (end > start) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(all.substr(start, end - start)));
      start = end + 1;
    }
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, s->store);
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
  *out = new DflashGroup{pg, timeout};
  GUARD_END
}

// Take over a backend made elsewhere (a reference released from an intrusive_ptr).
DflashGroup* dflash_c10d_group_adopt(void* backend, int64_t timeout_ms) {
  auto b = c10::intrusive_ptr<c10d::Backend>::reclaim(static_cast<c10d::Backend*>(backend));
  return new DflashGroup{b, std::chrono::milliseconds(timeout_ms)};
}

void dflash_c10d_group_free(DflashGroup* g) { delete g; }

// Wait for a collective: on the CPU (Gloo) until it is done, at most the group's timeout; on
// CUDA (NCCL) the current stream waits for it and the watchdog enforces the timeout.
static void finish(DflashGroup* g, const c10::intrusive_ptr<c10d::Work>& work) {
  if (!work->wait(g->timeout)) throw std::runtime_error("the collective did not complete");
}

// Sum (op 0) or max (op 1) of one tensor across ranks, in place.
int dflash_c10d_all_reduce(DflashGroup* g, const at::Tensor* t, int op, char* err, size_t err_len) {
  GUARD_BEGIN
  std::vector<at::Tensor> v{*t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == 1 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  opts.timeout = g->timeout;
  finish(g, g->backend->allreduce(v, opts));
  GUARD_END
}

int dflash_c10d_broadcast(DflashGroup* g, const at::Tensor* t, int root, char* err, size_t err_len) {
  GUARD_BEGIN
  std::vector<at::Tensor> v{*t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = g->timeout;
  finish(g, g->backend->broadcast(v, opts));
  GUARD_END
}

// Every rank's `input` into `outputs[rank]` (each the input's size, in rank order).
int dflash_c10d_all_gather(DflashGroup* g, const at::Tensor* const* outputs, size_t world, const at::Tensor* input, char* err,
                           size_t err_len) {
  GUARD_BEGIN
  std::vector<std::vector<at::Tensor>> out(1);
  for (size_t i = 0; i < world; ++i) out[0].push_back(*outputs[i]);
  std::vector<at::Tensor> in{*input};
  c10d::AllgatherOptions opts;
  opts.timeout = g->timeout;
  finish(g, g->backend->allgather(out, in, opts));
  GUARD_END
}

int dflash_c10d_barrier(DflashGroup* g, char* err, size_t err_len) {
  GUARD_BEGIN
  c10d::BarrierOptions opts;
  opts.timeout = g->timeout;
  finish(g, g->backend->barrier(opts));
  GUARD_END
}

}  // extern "C"
