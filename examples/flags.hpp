// Command-line flags of the small examples: `--name value` pairs, numbers checked against a range,
// a usage message and exit status 2 for anything else.
//
//   const examples::Flags flags("char_lstm", "usage: char_lstm [--steps N] ...");
//   flags.parse(argc, argv, [&](const std::string& name, const std::string& value) {
//     if (name == "--steps") steps = static_cast<long>(flags.number(name, value, 0, 1e7));
//     else return false;  // unknown flag
//     return true;
//   });
#pragma once

#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>

namespace examples {

class Flags {
 public:
  Flags(std::string program, std::string usage) : program_(std::move(program)), usage_(std::move(usage)) {}

  [[noreturn]] void fail(const std::string& message) const {
    std::cerr << program_ << ": " << message << "\n" << usage_ << "\n";
    std::exit(2);
  }

  // `value` as a number in [lo, hi], or the usage message naming `flag`.
  double number(const std::string& flag, const std::string& value, double lo, double hi) const {
    char* end = nullptr;
    const double x = std::strtod(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0' || !(x >= lo && x <= hi))
      fail(flag + " needs a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + value + "'");
    return x;
  }

  // Calls on(name, value) for every `--name value`; `on` returns false for a name it does not know.
  template <class On>
  void parse(int argc, char** argv, On on) const {
    for (int i = 1; i < argc; ++i) {
      const std::string name = argv[i];
      if (name == "--help" || name == "-h") fail("help");
      if (i + 1 >= argc) fail(name + " needs a value");
      const std::string value = argv[++i];
      if (!on(name, value)) fail("unknown flag '" + name + "'");
    }
  }

 private:
  std::string program_, usage_;
};

}  // namespace examples
