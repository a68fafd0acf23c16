// Warnings: for input that is legal but surely a mistake (e.g. a RematScope layer list that matched
// no module call). By default they go to stderr as "linum warning: ..."; a program may route them
// elsewhere (a logger, or an exception in tests) with set_warning_handler.
#pragma once

#include <functional>
#include <string>

namespace linum {

using WarningHandler = std::function<void(const std::string& message)>;

// Installs `handler` (null restores the default) and returns the previous one. Process-wide.
WarningHandler set_warning_handler(WarningHandler handler);

// Emits a warning through the current handler.
void warn(const std::string& message);

}  // namespace linum
