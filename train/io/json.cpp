// JSON encoding of trees: floats exact (subnormals, NaN payloads and infinities as strings),
// bf16 and int32 leaves tagged with their dtype, the reader as strict as the MessagePack one.
#include <linum/core/fp_mode.hpp>
#include <linum/train/io/serialization.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include <linum/train/io/serialization_internal.hpp>
#include <nlohmann/json.hpp>

namespace linum::serialization {

using namespace internal;

namespace {

std::string nan_string(std::uint32_t bits) {
  if (bits == 0x7fc00000u) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "nan(0x%08" PRIx32 ")", bits);
  return buf;
}

template <class Json>
Json float_json(float v) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
  if (std::isnan(v)) return Json(nan_string(bits));
  if (std::isinf(v)) return Json(v > 0 ? "inf" : "-inf");
  // The shortest decimal for the float reads more easily than the exact double (0.1 rather than
  // 0.10000000149011612); use it when, read as a double and rounded to float, it gives the same bits.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  double d = 0;
  auto back = std::from_chars(buf, res.ptr, d);
  if (back.ec == std::errc() && std::bit_cast<std::uint32_t>(static_cast<float>(d)) == bits) return Json(d);
  return Json(static_cast<double>(v));
}

template <class Json>
Json leaf_json(const Array& a) {
  Json j = Json::object();
  Json shape = Json::array();
  for (auto d : a.shape()) shape.push_back(d);
  j["shape"] = std::move(shape);
  j["dtype"] = dtype_name(a.dtype());
  Json data = Json::array();
  auto n = static_cast<std::size_t>(a.numel());
  data.template get_ref<typename Json::array_t&>().reserve(n);
  if (a.dtype() == DType::f32) {
    const float* p = a.data();
    for (std::size_t i = 0; i < n; ++i) data.push_back(float_json<Json>(p[i]));
  } else if (a.dtype() == DType::bf16) {  // every bfloat16 value is a float32 value: written exactly
    const bfloat16* p = a.data_bf16();
    for (std::size_t i = 0; i < n; ++i) data.push_back(float_json<Json>(static_cast<float>(p[i])));
  } else {
    const std::int32_t* p = a.data_i32();
    for (std::size_t i = 0; i < n; ++i) data.push_back(p[i]);
  }
  j["data"] = std::move(data);
  return j;
}

nlohmann::ordered_json tree_json(const Tree& t) {
  if (t.is_leaf()) return leaf_json<nlohmann::ordered_json>(t.array());
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [k, v] : t) j[k] = tree_json(v);
  return j;
}

template <class Json>
class JsonReader {
 public:
  JsonReader(std::string_view source) : source_(source) {}

  [[noreturn]] void fail(const std::string& msg) const {
    std::string p;
    for (const auto& k : path_) p = join_path(p, k);
    throw IoError(detail::cat("cannot load '", source_, "': ", p.empty() ? std::string() : p + ": ", msg));
  }

  static const char* type_name(const Json& j) { return j.type_name(); }

  float element_f32(const Json& e, std::size_t i) {
    if (e.is_number_float()) {
      double d = e.template get<double>();
      if (std::isnan(d)) return std::numeric_limits<float>::quiet_NaN();
      // Values up to FLT_MAX + half an ulp round to FLT_MAX (e.g. 3.4028235e+38); beyond, to infinity.
      constexpr double kOverflow = 0x1.ffffffp127;
      if (!std::isinf(d) && std::fabs(d) >= kOverflow)
        fail(detail::cat("data[", i, "] = ", fmt_double(d), " is outside the float32 range"));
      return static_cast<float>(d);
    }
    if (e.is_number_integer()) {
      if (e.is_number_unsigned()) return static_cast<float>(e.template get<std::uint64_t>());
      return static_cast<float>(e.template get<std::int64_t>());
    }
    if (e.is_string()) {
      const auto& s = e.template get_ref<const typename Json::string_t&>();
      if (s == "nan") return std::bit_cast<float>(0x7fc00000u);
      if (s == "inf") return std::numeric_limits<float>::infinity();
      if (s == "-inf") return -std::numeric_limits<float>::infinity();
      if (s.size() == 15 && s.compare(0, 6, "nan(0x") == 0 && s.back() == ')') {
        std::uint32_t bits = 0;
        auto [p, ec] = std::from_chars(s.data() + 6, s.data() + 14, bits, 16);
        if (ec == std::errc() && p == s.data() + 14 && std::isnan(std::bit_cast<float>(bits)))
          return std::bit_cast<float>(bits);
      }
      fail(detail::cat("data[", i, "] is the string \"", s.substr(0, 40),
                       "\"; float elements are numbers or \"nan\", \"inf\", \"-inf\", \"nan(0xXXXXXXXX)\""));
    }
    fail(detail::cat("data[", i, "] is a JSON ", type_name(e), "; float32 elements must be numbers"));
  }

  std::int32_t element_i32(const Json& e, std::size_t i) {
    if (e.is_number_unsigned()) {
      auto v = e.template get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
        fail(detail::cat("data[", i, "] = ", v, " does not fit in int32"));
      return static_cast<std::int32_t>(v);
    }
    if (e.is_number_integer()) {
      auto v = e.template get<std::int64_t>();
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        fail(detail::cat("data[", i, "] = ", v, " does not fit in int32"));
      return static_cast<std::int32_t>(v);
    }
    fail(detail::cat("data[", i, "] is a JSON ", type_name(e), "; int32 elements must be integers"));
  }

  Array leaf(const Json& j) {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "shape" && it.key() != "dtype" && it.key() != "data")
        fail(detail::cat("array entry has an unexpected field '", it.key(),
                         "'; an array is {\"shape\": [...], \"dtype\": \"float32\", \"data\": [...]}"));
    if (!j.contains("shape") || !j.contains("data"))
      fail("array entry needs \"shape\", \"dtype\" and \"data\" fields");
    const auto& dt = j["dtype"].template get_ref<const typename Json::string_t&>();
    DType dtype;
    if (dt == "float32")
      dtype = DType::f32;
    else if (dt == "bfloat16")
      dtype = DType::bf16;
    else if (dt == "int32")
      dtype = DType::i32;
    else
      fail(detail::cat("unsupported dtype \"", dt.substr(0, 40), "\"; JSON files hold float32, bfloat16 or int32 arrays"));
    const Json& shape = j["shape"];
    if (!shape.is_array()) fail(detail::cat("\"shape\" must be an array of integers, found ", type_name(shape)));
    if (shape.size() > static_cast<std::size_t>(Shape::kMaxRank))
      fail(detail::cat("array of rank ", shape.size(), " is not supported (at most ", Shape::kMaxRank, ")"));
    std::vector<std::int64_t> dims;
    for (const auto& d : shape) {
      if (!d.is_number_integer()) fail(detail::cat("\"shape\" entries must be integers, found ", type_name(d)));
      if (!d.is_number_unsigned() && d.template get<std::int64_t>() < 0)
        fail(detail::cat("\"shape\" has a negative dimension ", d.template get<std::int64_t>()));
      if (d.is_number_unsigned() &&
          d.template get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail("\"shape\" has a dimension that is too large");
      dims.push_back(d.template get<std::int64_t>());
    }
    auto numel = checked_numel(dims);
    if (!numel) fail(detail::cat("shape ", dims_str(dims), " is too large"));
    const Json& data = j["data"];
    if (!data.is_array()) fail(detail::cat("\"data\" must be an array, found ", type_name(data)));
    if (data.size() != static_cast<std::uint64_t>(*numel))
      fail(detail::cat("shape ", dims_str(dims), " needs ", *numel, " elements of ", dt, " data, found ", data.size()));
    Array out = Array::empty(Shape(dims), dtype);
    std::size_t i = 0;
    if (dtype == DType::f32) {
      float* p = out.mutable_data();
      for (const auto& e : data) p[i] = element_f32(e, i), ++i;
    } else if (dtype == DType::bf16) {
      bfloat16* p = out.mutable_data_bf16();
      for (const auto& e : data) {
        const float v = element_f32(e, i);
        p[i] = bfloat16(v);
        if (std::isnan(v)) {  // keep the NaN's bits (a signalling payload included) where bfloat16 can hold them
          bfloat16 exact;
          exact.bits = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16);
          if (std::isnan(static_cast<float>(exact))) p[i] = exact;
        }
        if (!std::isnan(v) && std::bit_cast<std::uint32_t>(static_cast<float>(p[i])) != std::bit_cast<std::uint32_t>(v))
          fail(detail::cat("\"data\"[", i, "] = ", fmt_double(v), " is not exactly representable as bfloat16"));
        ++i;
      }
    } else {
      std::int32_t* p = out.mutable_data_i32();
      for (const auto& e : data) p[i] = element_i32(e, i), ++i;
    }
    return out;
  }

  Tree value(const Json& j, int depth) {
    if (depth > kMaxDepth) fail(detail::cat("nesting deeper than ", kMaxDepth, " levels"));
    if (!j.is_object())
      fail(detail::cat("found a JSON ", type_name(j), "; a tree holds only objects (dicts and arrays)"));
    auto dt = j.find("dtype");
    if (dt != j.end() && dt->is_string()) return Tree(leaf(j));
    std::vector<Tree::Entry> entries;
    entries.reserve(j.size());
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      if (k.empty()) fail("empty key; tree keys must be non-empty strings");
      if (k.find('/') != std::string::npos)
        fail(detail::cat("key '", k, "' contains '/', which Linum uses to separate path components"));
      path_.push_back(k);
      Tree v = value(it.value(), depth + 1);
      path_.pop_back();
      entries.emplace_back(k, std::move(v));
    }
    try {
      return Tree::from_entries(std::move(entries));
    } catch (const ValueError& err) {
      fail(err.what());
    }
  }

 private:
  std::string_view source_;
  std::vector<std::string> path_;
};

}  // namespace

namespace internal {

void write_json_text(std::string& out, const Tree& t, int indent) {
  if (t.is_leaf()) {
    out += leaf_json<nlohmann::ordered_json>(t.array()).dump();
    return;
  }
  if (t.size() == 0) {
    out += "{}";
    return;
  }
  out += "{\n";
  std::size_t i = 0;
  for (const auto& [k, v] : t) {
    out.append(static_cast<std::size_t>(indent + 2), ' ');
    out += nlohmann::ordered_json(k).dump();
    out += ": ";
    write_json_text(out, v, indent + 2);
    out += ++i == t.size() ? "\n" : ",\n";
  }
  out.append(static_cast<std::size_t>(indent), ' ');
  out += "}";
}

}  // namespace internal

// JSON holds numbers as doubles: converting subnormal floats to and from them must not flush.
nlohmann::ordered_json to_json(const Tree& tree) {
  IeeeSubnormalScope exact;
  return tree_json(tree);
}

Tree from_json(const nlohmann::ordered_json& json, std::string_view source) {
  IeeeSubnormalScope exact;
  JsonReader<nlohmann::ordered_json> r(source);
  return r.value(json, 0);
}

Tree from_json(const nlohmann::json& json, std::string_view source) {
  IeeeSubnormalScope exact;
  JsonReader<nlohmann::json> r(source);
  return r.value(json, 0);
}

}  // namespace linum::serialization
