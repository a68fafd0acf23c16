// Module configurations as JSON: every layer's hyperparameters reflected with Boost.Hana, and
// generic conversions that work for any Hana-adapted struct (including users' own modules).
//
//   nlohmann::json c = nn::module_config(nn::Dense{.features = 10});   // {"features":10,"use_bias":true}
//   auto d = nn::module_from_config<nn::Dense>(c);                      // the same Dense again
//
//   struct MLP { int features = 128; double dropout_rate = 0.1; ... };
//   BOOST_HANA_ADAPT_STRUCT(MLP, features, dropout_rate);                // at global scope
//   std::cout << nn::module_config(MLP{}).dump();
//
// Only plain fields are reflected: initializers (std::function) are code, not configuration, and
// keep their defaults when a module is loaded. Fields may be bool, integers, floating point,
// std::string, std::optional (JSON null when empty), std::vector, std::pair, linum::Padding and
// other Hana-adapted structs (nested objects). This is the one header that includes
// <boost/hana.hpp>; include it only where configurations are needed.
#pragma once

#include <linum/core/error.hpp>
#include <linum/nn/attention.hpp>
#include <linum/nn/conv.hpp>
#include <linum/nn/dense.hpp>
#include <linum/nn/dropout.hpp>
#include <linum/nn/einsum.hpp>
#include <linum/nn/embed.hpp>
#include <linum/nn/normalization.hpp>
#include <linum/nn/recurrent.hpp>
#include <linum/nn/sequential.hpp>
#include <linum/modules/scope.hpp>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>

#include <charconv>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

BOOST_HANA_ADAPT_STRUCT(linum::nn::Dense, features, use_bias, dtype, param_dtype, activation);
BOOST_HANA_ADAPT_STRUCT(linum::nn::DenseGeneral, features, axis, use_bias, dtype, param_dtype, activation);
BOOST_HANA_ADAPT_STRUCT(linum::nn::Conv, features, kernel_size, strides, padding, kernel_dilation, feature_group_count,
                        use_bias, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::ConvTranspose, features, kernel_size, strides, padding, kernel_dilation, use_bias, dtype,
                        param_dtype, transpose_kernel);
BOOST_HANA_ADAPT_STRUCT(linum::nn::Embed, num_embeddings, features, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::LayerNorm, epsilon, use_bias, use_scale, reduction_axes, feature_axes,
                        use_fast_variance, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::RMSNorm, epsilon, use_scale, reduction_axes, feature_axes, use_fast_variance, dtype,
                        param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::GroupNorm, num_groups, group_size, epsilon, use_bias, use_scale, reduction_axes,
                        use_fast_variance, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::InstanceNorm, epsilon, use_bias, use_scale, feature_axes, use_fast_variance, dtype,
                        param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::Einsum, shape, einsum_str, use_bias, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::ConvLSTMCell, features, kernel_size, strides, padding, use_bias, dtype, param_dtype);
BOOST_HANA_ADAPT_STRUCT(linum::nn::BatchNorm, use_running_average, axis, momentum, epsilon, use_bias, use_scale,
                        use_fast_variance, dtype, param_dtype, activation);
BOOST_HANA_ADAPT_STRUCT(linum::nn::Dropout, rate, broadcast_dims, deterministic, rng_collection);
BOOST_HANA_ADAPT_STRUCT(linum::nn::MultiHeadDotProductAttention, num_heads, qkv_features, out_features,
                        broadcast_dropout, dropout_rate, deterministic, use_bias, normalize_qk, dtype, param_dtype);

namespace linum::nn {

// True for structs adapted with BOOST_HANA_ADAPT_STRUCT (their fields can be listed).
template <class M>
concept ReflectedModule = boost::hana::Struct<M>::value;

namespace config_detail {

template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_pair : std::false_type {};
template <class A, class B> struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T> struct is_sequential : std::false_type {};
template <class... L> struct is_sequential<Sequential<L...>> : std::true_type {};

// A float as the double with the same shortest decimal spelling (1e-6f prints as 1e-06, not
// 9.99999997e-07).
inline double float_as_double(float f) {
  char buf[32];
  auto res = std::to_chars(buf, buf + sizeof(buf), f);
  *res.ptr = '\0';
  return std::strtod(buf, nullptr);
}

[[noreturn]] inline void bad_field(const std::string& where, const char* want, const nlohmann::json& got) {
  throw ValueError(detail::cat("module config: field '", where, "' must be ", want, ", got ", got.dump()));
}

template <class T>
nlohmann::json to_value(const T& v);
template <class T>
T from_value(const nlohmann::json& j, const std::string& where);

}  // namespace config_detail

// The configuration of a Hana-adapted module: a JSON object with one entry per reflected field
// (nlohmann::json keeps object keys sorted).
template <ReflectedModule M>
nlohmann::json module_config(const M& module) {
  nlohmann::json j = nlohmann::json::object();
  boost::hana::for_each(boost::hana::accessors<M>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    j[name] = config_detail::to_value(boost::hana::second(pair)(module));
  });
  return j;
}

// The configuration of a Sequential: {"layers": [config of each layer]}; plain functions in the
// layer list appear as null.
template <class... L>
nlohmann::json module_config(const Sequential<L...>& seq) {
  nlohmann::json layers = nlohmann::json::array();
  std::apply([&](const auto&... layer) { (layers.push_back(config_detail::to_value(layer)), ...); }, seq.layers);
  return nlohmann::json{{"layers", layers}};
}

// A module built from a configuration: fields missing from `config` keep their defaults (so do
// fields that are not reflected, such as initializers). Throws ValueError for a non-object, an
// unknown field (listing the known ones) or a value of the wrong type (naming the field).
template <ReflectedModule M>
M module_from_config(const nlohmann::json& config) {
  const std::string type = module_type_name<M>();
  if (!config.is_object())
    throw ValueError(detail::cat("module config for ", type, " must be a JSON object, got ", config.dump()));
  M module{};
  std::set<std::string> known;
  std::string known_list;
  boost::hana::for_each(boost::hana::accessors<M>(), [&](auto pair) {
    const char* name = boost::hana::to<const char*>(boost::hana::first(pair));
    known.insert(name);
    known_list += (known_list.empty() ? "" : ", ") + std::string(name);
    if (!config.contains(name)) return;
    auto& field = boost::hana::second(pair)(module);
    field = config_detail::from_value<std::remove_cvref_t<decltype(field)>>(config.at(name), type + "." + name);
  });
  for (const auto& [key, value] : config.items())
    if (!known.count(key))
      throw ValueError(detail::cat("module config for ", type, " has an unknown field '", key, "'; its fields are: ",
                                   known_list));
  // Ranges: a layer checks its hyperparameters on load, not only when it first runs.
  if constexpr (requires(const M& m) { m.validate(); }) {
    try {
      module.validate();
    } catch (const ValueError& e) {
      throw ValueError(detail::cat("module config: ", e.what()));
    }
  }
  return module;
}

// A Sequential built from {"layers": [...]}; every layer type must be Hana-adapted.
template <class S>
  requires config_detail::is_sequential<S>::value
S module_from_config(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("layers") || !config.at("layers").is_array() || config.size() != 1)
    throw ValueError(detail::cat("module config for Sequential must be {\"layers\": [...]}, got ", config.dump()));
  const auto& layers = config.at("layers");
  return [&]<class... L>(std::type_identity<Sequential<L...>>) {
    if (layers.size() != sizeof...(L))
      throw ValueError(detail::cat("module config for Sequential has ", layers.size(), " layers; this Sequential type has ",
                                   sizeof...(L)));
    std::size_t i = 0;
    auto next = [&]<class T>(std::type_identity<T>) { return module_from_config<T>(layers.at(i++)); };
    return Sequential<L...>{next(std::type_identity<L>{})...};
  }(std::type_identity<S>{});
}

namespace config_detail {

template <class T>
nlohmann::json to_value(const T& v) {
  if constexpr (std::is_same_v<T, bool> || std::is_integral_v<T> || std::is_same_v<T, std::string> ||
                std::is_same_v<T, double>) {
    return nlohmann::json(v);
  } else if constexpr (std::is_same_v<T, float>) {
    return nlohmann::json(float_as_double(v));
  } else if constexpr (std::is_same_v<T, DType>) {
    return nlohmann::json(dtype_name(v));  // "float32", "bfloat16", "int32" (NumPy's names)
  } else if constexpr (std::is_same_v<T, Activation>) {
    return nlohmann::json(std::string(activation_name(v)));  // "none", "relu", "gelu", ...
  } else if constexpr (is_optional<T>::value) {
    return v ? to_value(*v) : nlohmann::json(nullptr);
  } else if constexpr (is_vector<T>::value) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& e : v) a.push_back(to_value(e));
    return a;
  } else if constexpr (is_pair<T>::value) {
    return nlohmann::json::array({to_value(v.first), to_value(v.second)});
  } else if constexpr (std::is_same_v<T, linum::Padding>) {
    return v.mode().empty() ? to_value(v.pairs) : nlohmann::json(v.mode());
  } else if constexpr (ReflectedModule<T> || is_sequential<T>::value) {
    return module_config(v);
  } else if constexpr (std::is_pointer_v<T> || std::is_function_v<T>) {
    return nlohmann::json(nullptr);  // a plain function in a Sequential
  } else {
    static_assert(sizeof(T) == 0, "module_config: this field type cannot be written as JSON");
  }
}

template <class T>
T from_value(const nlohmann::json& j, const std::string& where) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) bad_field(where, "a boolean", j);
    return j.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!j.is_number_integer()) bad_field(where, "an integer", j);
    // Refuse values the field cannot hold instead of narrowing them ({"axis": 4294967295} is not -1).
    const auto max = static_cast<std::uint64_t>(std::numeric_limits<T>::max());
    bool fits;
    if (j.is_number_unsigned()) {
      fits = j.get<std::uint64_t>() <= max;
    } else {
      const std::int64_t v = j.get<std::int64_t>();
      fits = v >= 0 ? static_cast<std::uint64_t>(v) <= max
                    : std::is_signed_v<T> && v >= static_cast<std::int64_t>(std::numeric_limits<T>::min());
    }
    if (!fits)
      bad_field(where, detail::cat("an integer in [", +std::numeric_limits<T>::min(), ", ", +std::numeric_limits<T>::max(), "]").c_str(), j);
    return j.get<T>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!j.is_number()) bad_field(where, "a number", j);
    // Refuse what no hyperparameter means: a number that overflowed while parsing (1e999 is inf)
    // or one the field's type cannot hold (3e38 is fine for a double field, not for a float one).
    const double v = j.get<double>();
    if (!std::isfinite(v) || std::abs(v) > static_cast<double>(std::numeric_limits<T>::max()))
      bad_field(where, detail::cat("a finite number within +-", std::numeric_limits<T>::max()).c_str(), j);
    return static_cast<T>(v);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!j.is_string()) bad_field(where, "a string", j);
    return j.get<std::string>();
  } else if constexpr (std::is_same_v<T, DType>) {
    const std::string name = j.is_string() ? j.get<std::string>() : std::string();
    if (name == "float32" || name == "f32") return DType::f32;
    if (name == "bfloat16" || name == "bf16") return DType::bf16;
    if (name == "int32" || name == "i32") return DType::i32;
    bad_field(where, "a dtype (\"float32\" or \"bfloat16\")", j);
  } else if constexpr (std::is_same_v<T, Activation>) {
    if (!j.is_string()) bad_field(where, "an activation name (\"none\", \"relu\", \"gelu\", ...)", j);
    try {
      return activation_from_name(j.get<std::string>());
    } catch (const ValueError& e) {
      bad_field(where, e.what(), j);
    }
  } else if constexpr (is_optional<T>::value) {
    if (j.is_null()) return T{};
    return T{from_value<typename T::value_type>(j, where)};
  } else if constexpr (is_vector<T>::value) {
    if (!j.is_array()) bad_field(where, "an array", j);
    T out;
    for (std::size_t i = 0; i < j.size(); ++i)
      out.push_back(from_value<typename T::value_type>(j.at(i), where + "[" + std::to_string(i) + "]"));
    return out;
  } else if constexpr (is_pair<T>::value) {
    if (!j.is_array() || j.size() != 2) bad_field(where, "a pair [a, b]", j);
    return T{from_value<typename T::first_type>(j.at(0), where), from_value<typename T::second_type>(j.at(1), where)};
  } else if constexpr (std::is_same_v<T, linum::Padding>) {
    const char* expected = "\"SAME\", \"VALID\", \"CAUSAL\", an int >= 0 or [[low, high], ...]";
    try {
      if (j.is_string()) return linum::Padding(j.get<std::string>());
      if (j.is_number_integer()) return linum::Padding(j.get<int>());
    } catch (const ValueError&) {
      bad_field(where, expected, j);
    }
    if (!j.is_array()) bad_field(where, expected, j);
    return linum::Padding(from_value<std::vector<std::pair<std::int64_t, std::int64_t>>>(j, where));
  } else if constexpr (ReflectedModule<T> || is_sequential<T>::value) {
    return module_from_config<T>(j);
  } else {
    static_assert(sizeof(T) == 0, "module_from_config: this field type cannot be read from JSON");
  }
}

}  // namespace config_detail

}  // namespace linum::nn
