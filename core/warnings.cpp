#include <linum/core/warnings.hpp>

#include <iostream>
#include <mutex>
#include <utility>

namespace linum {
namespace {
std::mutex g_mutex;
WarningHandler g_handler;
}  // namespace

WarningHandler set_warning_handler(WarningHandler handler) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return std::exchange(g_handler, std::move(handler));
}

void warn(const std::string& message) {
  WarningHandler handler;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    handler = g_handler;
  }
  if (handler) handler(message);
  else std::cerr << "linum warning: " << message << std::endl;
}

}  // namespace linum
