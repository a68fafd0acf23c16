// prng_vectors: prints Linum's PRNG outputs for one seed as a JSON object, so that anyone with
// JAX can compare them value for value.
//
//   prng_vectors --seed N [--mode partitionable|legacy] [--x32]
//
// The fields and the JAX calls they correspond to (k = jax.random.key(N); under
// `jax.config.update("jax_threefry_partitionable", mode == "partitionable")`):
//   key            jax.random.key_data(k)
//   split2         key_data(split(k))            split4     key_data(split(k, 4))
//   fold_in_4      key_data(fold_in(k, 4))       bits_uint32_3  bits(k, (3,))
//   uniform_3      uniform(k, (3,))              normal_1   normal(k, (1,))
//   normal_3       normal(k, (3,))
// Floats are printed with 9 significant digits. Seeds are 64-bit, as JAX with jax_enable_x64;
// --x32 seeds the way default JAX (32-bit) does, which differs only for seeds outside [0, 2^32).
#include <linum/rng/rng.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <iostream>
#include <string>
#include <vector>

namespace rng = linum::rng;

namespace {

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "prng_vectors: " << message << "\n"
            << "usage: prng_vectors --seed N [--mode partitionable|legacy] [--x32]\n";
  std::exit(2);
}

nlohmann::json key_json(const rng::Key& k) { return nlohmann::json::array({k.hi, k.lo}); }

nlohmann::json keys_json(const std::vector<rng::Key>& keys) {
  auto out = nlohmann::json::array();
  for (const auto& k : keys) out.push_back(key_json(k));
  return out;
}

nlohmann::json floats_json(const linum::Array& a) {
  auto out = nlohmann::json::array();
  for (float x : a.to_vector()) out.push_back(static_cast<double>(x));
  return out;
}

// Compact JSON like json::dump(), except that floating-point numbers are written with 9
// significant digits ("%.9g", enough to identify every float32).
void write_json(std::ostream& os, const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    os << '{';
    bool first = true;
    for (const auto& [k, v] : j.items()) {
      if (!first) os << ',';
      first = false;
      os << nlohmann::json(k).dump() << ':';
      write_json(os, v);
    }
    os << '}';
  } else if (j.is_array()) {
    os << '[';
    for (std::size_t i = 0; i < j.size(); ++i) {
      if (i) os << ',';
      write_json(os, j[i]);
    }
    os << ']';
  } else if (j.is_number_float()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", j.get<double>());
    os << buf;
  } else {
    os << j.dump();
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t seed = 0;
  bool have_seed = false;
  bool x32 = false;
  rng::Mode mode = rng::Mode::partitionable;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--seed") {
      const std::string v = value();
      try {
        std::size_t used = 0;
        seed = std::stoll(v, &used, 10);
        if (used != v.size()) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        usage_error("--seed expects a 64-bit integer, got '" + v + "'");
      }
      have_seed = true;
    } else if (arg == "--mode") {
      const std::string v = value();
      try {
        mode = rng::parse_mode(v);
      } catch (const linum::ValueError&) {
        usage_error("--mode expects 'partitionable' or 'legacy', got '" + v + "'");
      }
    } else if (arg == "--x32") {
      x32 = true;
    } else if (arg == "--help" || arg == "-h") {
      std::cout << "usage: prng_vectors --seed N [--mode partitionable|legacy] [--x32]\n";
      return 0;
    } else {
      usage_error("unknown argument '" + arg + "'");
    }
  }
  if (!have_seed) usage_error("--seed is required");

  const rng::Key k = x32 ? rng::key_x32(seed) : rng::key(seed);
  nlohmann::ordered_json out;
  out["seed"] = seed;
  out["mode"] = rng::mode_name(mode);
  out["key"] = key_json(k);
  out["split2"] = keys_json(rng::split(k, 2, mode));
  out["split4"] = keys_json(rng::split(k, 4, mode));
  out["fold_in_4"] = key_json(rng::fold_in(k, 4));
  out["bits_uint32_3"] = rng::bits_u32(k, 3, mode);
  out["uniform_3"] = floats_json(rng::uniform(k, linum::Shape{3}, 0.0f, 1.0f, mode));
  out["normal_1"] = floats_json(rng::normal(k, linum::Shape{1}, mode));
  out["normal_3"] = floats_json(rng::normal(k, linum::Shape{3}, mode));
  write_json(std::cout, out);
  std::cout << "\n";
  return 0;
}
