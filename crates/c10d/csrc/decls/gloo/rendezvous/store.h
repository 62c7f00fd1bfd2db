// Declarations, not Gloo. The torch wheel ships ProcessGroupGloo.hpp but not Gloo's headers.
// ProcessGroupGloo holds Gloo objects only behind pointers, so to construct one and call it
// through c10d's Backend interface these names suffice; their code is libtorch_cpu's own copy.
// Nothing declared here is defined or called by us (GlooStore's inline overrides and setTimeout
// are compiled only if used, and we use neither).
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
namespace rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) = 0;
};
}  // namespace rendezvous
}  // namespace gloo
