// Trees of variables (core/tree.hpp) and their MessagePack / JSON serialization
// (train/io/serialization.hpp).
#include <doctest/doctest.h>
#include <linum/train/io/serialization.hpp>
#include <linum/core/tree.hpp>
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <chrono>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

using namespace linum;
namespace ser = linum::serialization;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<std::uint8_t>;

Array f32(const Shape& shape, std::initializer_list<float> v) { return Array::from(shape, v); }

// The variable dict of a two-layer MLP.
Tree mlp_vars() {
  return Tree{{"params",
               {{"Dense_0", {{"kernel", Array::arange(6).with_shape(Shape{2, 3})}, {"bias", Array::zeros(Shape{3})}}},
                {"Dense_1", {{"kernel", Array::ones(Shape{3, 1})}, {"bias", Array::zeros(Shape{1})}}}}},
              {"batch_stats", {{"count", Array::from_i32(Shape{}, {7})}}}};
}

std::string error_of(const auto& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

Bytes hex_bytes(std::string_view hex) {
  Bytes out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<std::uint8_t>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

// Element by element: GCC 12's -Warray-bounds misfires on vector::insert into small vectors.
void append(Bytes& b, std::string_view s) {
  for (char c : s) b.push_back(static_cast<std::uint8_t>(c));
}
void append(Bytes& b, const Bytes& more) {
  for (auto x : more) b.push_back(x);
}

float bits_f(std::uint32_t b) { return std::bit_cast<float>(b); }

// A tree full of values that are easy to get subtly wrong.
Tree tricky_tree() {
  std::vector<float> specials = {0.0f, -0.0f, 1.0f, -1.0f, 0.1f, 1.0f / 3.0f, 3.14159274f,
                                 std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(), bits_f(0xffc00000u) /* -nan */,
                                 bits_f(0x7f800001u) /* signalling NaN payload */, bits_f(0x7fc12345u),
                                 std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                                 bits_f(0x007fffffu) /* largest denormal */, std::numeric_limits<float>::min(),
                                 std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                                 std::numeric_limits<float>::epsilon(), 16777217.0f, 1e-30f, 123456.789f};
  std::mt19937 rng(42);
  std::vector<float> randoms(1000);
  for (auto& x : randoms) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));  // any bit pattern
  std::vector<std::int32_t> ints = {0, 1, -1, std::numeric_limits<std::int32_t>::min(),
                                    std::numeric_limits<std::int32_t>::max(), 127, 128, -32, -33, 65536};
  std::vector<float> big(20000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.37f - 50.0f;

  Tree t;
  t.set_path("params/specials", Array::from(Shape{static_cast<std::int64_t>(specials.size())}, specials));
  t.set_path("params/random_bits", Array::from(Shape{10, 100}, randoms));
  t.set_path("params/ints", Array::from_i32(Shape{2, 5}, ints));
  t.set_path("params/scalar", Array::scalar(-2.5f));
  t.set_path("params/int_scalar", Array::from_i32(Shape{}, {-7}));
  t.set_path("params/zero_size", Array::zeros(Shape{0, 3}));
  t.set_path("params/big_bin32", Array::from(Shape{20000}, big));           // > 65535 bytes
  t.set_path("params/mid_bin16", Array::zeros(Shape{5, 20}));               // 400 bytes
  t.set_path("params/rank8", Array::ones(Shape{1, 2, 1, 2, 1, 2, 1, 2}));
  t["empty"] = Tree();
  t.set_path("nested/empty/inside", Tree());
  std::string long_key(40, 'k');    // str8
  std::string longer_key(300, 'q');  // str16
  t.set_path("keys/" + long_key, Array::scalar(1.0f));
  t.set_path("keys/" + longer_key, Array::scalar(2.0f));
  for (int i = 0; i < 20; ++i) t.set_path("many/entry_" + std::to_string(i), Array::full(Shape{1}, float(i)));  // map16
  t.set_path("unicode/gewicht_\xc3\xbc", Array::scalar(3.0f));
  t.set_path("order/z", Array::scalar(1.0f));
  t.set_path("order/a", Array::scalar(2.0f));
  t.set_path("order/m", Array::scalar(3.0f));
  return t;
}

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("linum_test_tree_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::string> dir_entries(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

Bytes file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

// =================================================================================================
// Tree
// =================================================================================================

TEST_CASE("tree: construction, kinds and dict access keep insertion order") {
  Tree t = mlp_vars();
  CHECK(t.is_dict());
  CHECK_FALSE(t.is_leaf());
  CHECK(t.keys() == std::vector<std::string>{"params", "batch_stats"});
  CHECK(t["params"].keys() == std::vector<std::string>{"Dense_0", "Dense_1"});
  CHECK(t.at("params").at("Dense_0").keys() == std::vector<std::string>{"kernel", "bias"});
  const Tree& k = t.at("params").at("Dense_0").at("kernel");
  CHECK(k.is_leaf());
  CHECK(k.array().shape() == Shape{2, 3});
  CHECK(k.size() == 0);
  CHECK(t.size() == 2);
  CHECK(t.contains("params"));
  CHECK_FALSE(t.contains("param"));
  CHECK_FALSE(k.contains("x"));

  std::vector<std::string> seen;
  for (const auto& [key, sub] : t["params"]) seen.push_back(key + (sub.is_dict() ? "{}" : ""));
  CHECK(seen == std::vector<std::string>{"Dense_0{}", "Dense_1{}"});

  Tree empty;
  CHECK(empty.is_dict());
  CHECK(empty.empty());
  CHECK(empty.size() == 0);
  CHECK(empty.begin() == empty.end());

  // operator[] creates an empty dict at the end; set replaces in place.
  Tree u;
  u["b"] = Array::scalar(1.0f);
  u["a"]["x"] = Array::scalar(2.0f);
  u.set("c", Array::scalar(3.0f));
  CHECK(u.keys() == std::vector<std::string>{"b", "a", "c"});
  u.set("b", Array::scalar(9.0f));
  CHECK(u.keys() == std::vector<std::string>{"b", "a", "c"});
  CHECK(u.at("b").array().item() == 9.0f);
  CHECK(u.erase("a"));
  CHECK_FALSE(u.erase("a"));
  CHECK(u.keys() == std::vector<std::string>{"b", "c"});
}

TEST_CASE("tree: misuse gives ValueError with a message that says what is wrong") {
  Tree t = mlp_vars();
  std::string msg = error_of([&] { (void)t.at("params").at("Dense_2"); });
  CHECK(msg.find("'Dense_2'") != std::string::npos);
  CHECK(msg.find("'Dense_0', 'Dense_1'") != std::string::npos);
  CHECK_THROWS_AS((void)t.at("nope"), ValueError);

  const Tree& ct = t;
  CHECK_THROWS_AS((void)ct["nope"], ValueError);  // const [] never inserts

  CHECK_THROWS_AS(t.set("a/b", Array::scalar(1.0f)), ValueError);
  CHECK(error_of([&] { t["a/b"]; }).find("contains '/'") != std::string::npos);
  CHECK_THROWS_AS(t.set("", Array::scalar(1.0f)), ValueError);
  CHECK_THROWS_AS((Tree{{"x", Array::scalar(1.0f)}, {"x", Array::scalar(2.0f)}}), ValueError);
  CHECK_THROWS_AS((void)Tree(Array()), ValueError);

  Tree leaf = Array::scalar(1.0f);
  CHECK_THROWS_AS(leaf["x"], ValueError);
  CHECK_THROWS_AS(leaf.set("x", Tree()), ValueError);
  CHECK_THROWS_AS(leaf.erase("x"), ValueError);
  CHECK(error_of([&] { (void)t.array(); }).find("not a leaf") != std::string::npos);
  CHECK(leaf.keys().empty());
}

TEST_CASE("tree: paths") {
  Tree t = mlp_vars();
  CHECK(t.at_path("params/Dense_1/kernel").array().shape() == Shape{3, 1});
  CHECK(&t.at_path("") == &t);
  CHECK(t.contains_path("params/Dense_0"));
  CHECK(t.contains_path(""));
  CHECK_FALSE(t.contains_path("params/Dense_0/kernel/x"));
  CHECK_FALSE(t.contains_path("params//Dense_0"));
  CHECK_FALSE(t.contains_path("params/Dense_9"));

  std::string msg = error_of([&] { (void)t.at_path("params/Dense_0/kernal"); });
  CHECK(msg.find("params/Dense_0/kernal") != std::string::npos);
  CHECK(msg.find("no entry 'kernal' at 'params/Dense_0'") != std::string::npos);
  CHECK(msg.find("'kernel', 'bias'") != std::string::npos);
  CHECK(error_of([&] { (void)t.at_path("params/Dense_0/kernel/x"); }).find("is a leaf") != std::string::npos);
  CHECK(error_of([&] { (void)t.at_path("/params"); }).find("empty component") != std::string::npos);
  CHECK_THROWS_AS((void)t.at_path("params/"), ValueError);

  Tree u;
  u.set_path("a/b/c", Array::scalar(1.0f));
  u.set_path("a/b/d", Array::scalar(2.0f));
  u.set_path("a/e", Array::scalar(3.0f));
  CHECK(u.keys() == std::vector<std::string>{"a"});
  CHECK(u.at("a").keys() == std::vector<std::string>{"b", "e"});
  CHECK(u.at_path("a/b/d").array().item() == 2.0f);
  u.set_path("a/b/c", Array::scalar(5.0f));  // replace
  CHECK(u.at_path("a/b/c").array().item() == 5.0f);
  CHECK_THROWS_AS(u.set_path("a/b/c/x", Array::scalar(1.0f)), ValueError);  // through a leaf
  CHECK_THROWS_AS(u.set_path("", Array::scalar(1.0f)), ValueError);
  CHECK_THROWS_AS(u.set_path("a//x", Array::scalar(1.0f)), ValueError);
  u.at_path("a/b") = Array::scalar(0.0f);  // mutable access replaces a subtree
  CHECK(u.at_path("a/b").is_leaf());
}

TEST_CASE("tree: flatten, unflatten, leaves and with_leaves agree on the order") {
  Tree t = mlp_vars();
  auto flat = flatten(t);
  std::vector<std::string> paths;
  for (const auto& [p, a] : flat) paths.push_back(p);
  CHECK(paths == std::vector<std::string>{"params/Dense_0/kernel", "params/Dense_0/bias", "params/Dense_1/kernel",
                                          "params/Dense_1/bias", "batch_stats/count"});
  CHECK(flat[0].second.shares_buffer(t.at_path("params/Dense_0/kernel").array()));

  Tree back = unflatten(flat);
  CHECK(bitwise_equal(back, t));
  CHECK(back.keys() == t.keys());

  auto ls = leaves(t);
  REQUIRE(ls.size() == 5);
  CHECK(leaf_count(t) == 5);
  for (std::size_t i = 0; i < ls.size(); ++i) CHECK(ls[i].shares_buffer(flat[i].second));

  std::vector<Array> doubled;
  for (const auto& a : ls) doubled.push_back(a);
  doubled[1] = Array::full(Shape{3}, 4.0f);
  Tree w = with_leaves(t, doubled);
  CHECK(same_structure(w, t));
  CHECK(w.at_path("params/Dense_0/bias").array().to_vector() == std::vector<float>{4, 4, 4});
  CHECK_THROWS_AS(with_leaves(t, std::vector<Array>(4)), ValueError);

  // A leaf at the root has the empty path; empty dicts have no leaves.
  Tree leaf = Array::scalar(1.0f);
  auto lf = flatten(leaf);
  REQUIRE(lf.size() == 1);
  CHECK(lf[0].first.empty());
  CHECK(unflatten(lf).is_leaf());
  CHECK(flatten(Tree{{"e", Tree()}}).empty());
  CHECK(unflatten({}).empty());

  CHECK_THROWS_AS(unflatten({{"a/b", Array::scalar(1.0f)}, {"a/b", Array::scalar(2.0f)}}), ValueError);
  CHECK_THROWS_AS(unflatten({{"a/b", Array::scalar(1.0f)}, {"a", Array::scalar(2.0f)}}), ValueError);
  CHECK_THROWS_AS(unflatten({{"a", Array::scalar(1.0f)}, {"a/b", Array::scalar(2.0f)}}), ValueError);
  CHECK_THROWS_AS(unflatten({{"a//b", Array::scalar(1.0f)}}), ValueError);
  CHECK_THROWS_AS(unflatten({{"", Array::scalar(1.0f)}, {"a", Array::scalar(2.0f)}}), ValueError);
}

TEST_CASE("tree: tree_map over one and two trees") {
  Tree t = mlp_vars();
  Tree shapes_only = tree_map([](const Array& a) { return Array::zeros(a.shape(), a.dtype()); }, t);
  CHECK(same_structure(shapes_only, t));
  CHECK_FALSE(bitwise_equal(shapes_only, t));
  CHECK(param_count(shapes_only) == param_count(t));

  Tree sum = tree_map(
      [](const Array& a, const Array& b) {
        if (a.dtype() != DType::f32) return a;
        std::vector<float> v = a.to_vector(), w = b.to_vector();
        for (std::size_t i = 0; i < v.size(); ++i) v[i] += w[i];
        return Array::from(a.shape(), v);
      },
      t, t);
  CHECK(sum.at_path("params/Dense_0/kernel").array().to_vector() == std::vector<float>{0, 2, 4, 6, 8, 10});

  Tree other = t;
  other["params"].erase("Dense_1");
  std::string msg = error_of([&] { tree_map([](const Array& a, const Array&) { return a; }, t, other); });
  CHECK(msg.find("params: keys differ: [Dense_0, Dense_1] vs [Dense_0]") != std::string::npos);

  Tree reordered{{"batch_stats", t.at("batch_stats")}, {"params", t.at("params")}};
  CHECK_THROWS_AS(tree_map([](const Array& a, const Array&) { return a; }, t, reordered), ValueError);

  // Shapes may differ in a two-tree map (only keys must agree).
  Tree t2 = t;
  t2.set_path("params/Dense_0/bias", Array::zeros(Shape{7}));
  CHECK_NOTHROW(tree_map([](const Array& a, const Array&) { return a; }, t, t2));

  std::vector<std::string> paths;
  tree_map_with_path([&](const std::string& p, const Array& a) { paths.push_back(p); return a; }, t);
  CHECK(paths.front() == "params/Dense_0/kernel");
  CHECK(paths.back() == "batch_stats/count");
}

TEST_CASE("tree: counts, structural equality, diff and printing") {
  Tree t = mlp_vars();
  CHECK(param_count(t) == 6 + 3 + 3 + 1 + 1);
  CHECK(byte_count(t) == 4 * 14);
  CHECK(param_count(Tree()) == 0);

  Tree copy = t;
  CHECK(same_structure(copy, t));
  CHECK(bitwise_equal(copy, t));
  copy.set_path("params/Dense_0/bias", Array::full(Shape{3}, -0.0f));
  CHECK(same_structure(copy, t));
  CHECK_FALSE(bitwise_equal(copy, t));  // -0.0 differs from 0.0 bitwise
  copy.set_path("params/Dense_0/bias", Array::zeros(Shape{3}, DType::i32));
  CHECK_FALSE(same_structure(copy, t));
  CHECK(*structure_difference(t, copy) == "params/Dense_0/bias: float32(3,) vs int32(3,)");
  CHECK_FALSE(structure_difference(t, copy, false).has_value());
  Tree nan_a{{"x", Array::scalar(std::numeric_limits<float>::quiet_NaN())}};
  CHECK(bitwise_equal(nan_a, nan_a));

  Tree actual = t;
  actual["params"].erase("Dense_1");
  actual.set_path("params/Dense_0/kernel", Array::zeros(Shape{3, 2}));
  actual.set_path("params/Dense_2/kernel", Array::zeros(Shape{1}));
  actual.set_path("extra_collection", Tree());
  TreeDiff d = diff(t, actual);
  CHECK(d.missing == std::vector<std::string>{"params/Dense_1/kernel", "params/Dense_1/bias"});
  CHECK(d.extra == std::vector<std::string>{"params/Dense_2/kernel", "extra_collection"});
  CHECK(d.mismatched == std::vector<std::string>{"params/Dense_0/kernel: expected float32(2, 3), found float32(3, 2)"});
  CHECK(d.str() ==
        "missing entries: params/Dense_1/kernel, params/Dense_1/bias; extra entries: params/Dense_2/kernel, "
        "extra_collection; mismatched entries: params/Dense_0/kernel: expected float32(2, 3), found float32(3, 2)");
  CHECK(diff(t, t).empty());
  CHECK(diff(t, t).str().empty());
  Tree reordered{{"batch_stats", t.at("batch_stats")}, {"params", t.at("params")}};
  CHECK(diff(t, reordered).empty());  // diff ignores order; same_structure does not
  CHECK_FALSE(same_structure(t, reordered));

  CHECK(t.str() ==
        "{\n"
        "  params: {\n"
        "    Dense_0: {\n"
        "      kernel: float32(2, 3)\n"
        "      bias: float32(3,)\n"
        "    }\n"
        "    Dense_1: {\n"
        "      kernel: float32(3, 1)\n"
        "      bias: float32(1,)\n"
        "    }\n"
        "  }\n"
        "  batch_stats: {\n"
        "    count: int32()\n"
        "  }\n"
        "}");
  CHECK(Tree().str() == "{}");
  std::ostringstream os;
  os << Tree{{"a", Tree()}};
  CHECK(os.str() == "{\n  a: {}\n}");
}

// =================================================================================================
// MessagePack, Flax layout
// =================================================================================================

TEST_CASE("msgpack: the bytes Flax writes for {'a': np.zeros((2,), np.float32)}") {
  // flax.serialization.msgpack_serialize(d) == msgpack.packb(d, default=_msgpack_ext_pack, strict_types=True)
  // where an ndarray becomes ExtType(1, msgpack.packb((shape, dtype.name, tobytes('C')), use_bin_type=True)).
  Bytes inner;
  inner.push_back(0x93);               // fixarray, 3 elements: (shape, dtype name, data)
  inner.push_back(0x91);               //   shape: fixarray, 1 element
  inner.push_back(0x02);               //     positive fixint 2
  inner.push_back(0xa7);               //   fixstr, 7 bytes
  append(inner, "float32");            //     "float32"
  inner.push_back(0xc4);               //   bin 8
  inner.push_back(0x08);               //     8 bytes
  for (int i = 0; i < 8; ++i) inner.push_back(0x00);  // two little-endian 0.0f
  REQUIRE(inner.size() == 21);

  Bytes expected;
  expected.push_back(0x81);  // fixmap, 1 entry
  expected.push_back(0xa1);  // fixstr, 1 byte
  append(expected, "a");
  expected.push_back(0xc7);  // ext 8 (21 is not a fixext length)
  expected.push_back(0x15);  //   21 bytes of payload
  expected.push_back(0x01);  //   type 1: Flax's _MsgpackExtType.ndarray
  expected.insert(expected.end(), inner.begin(), inner.end());

  Tree t{{"a", Array::zeros(Shape{2})}};
  CHECK(ser::to_msgpack(t) == expected);
  Tree back = ser::from_msgpack(expected);
  CHECK(bitwise_equal(back, t));

  // The same bytes as printed by Python's msgpack 1.0.3 running flax.serialization's encoder.
  CHECK(expected == hex_bytes("81a161c71501939102a7666c6f61743332c4080000000000000000"));
}

TEST_CASE("msgpack: a nested Flax file with fixext records, int32, numpy scalars and empty dicts") {
  // Python (msgpack 1.0.3, numpy 1.24, flax.serialization's encoder):
  //   {"params": {"Dense_0": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
  //                           "bias": np.array([1, -2, 3], np.int32)}},
  //    "s": np.float32(2.5), "r0": np.array(7.0, np.float32), "e": {}}
  Bytes flax = hex_bytes(
      "84a6706172616d7381a744656e73655f3082a66b65726e656cc7260193920203a7666c6f61743332c418000000000000803f00000040"
      "00004040000080400000a040a462696173c71701939103a5696e743332c40c01000000feffffff03000000a173d8039390a7666c6f6174"
      "3332c40400002040a27230d8019390a7666c6f61743332c4040000e040a16580");
  Tree t = ser::from_msgpack(flax);
  CHECK(t.keys() == std::vector<std::string>{"params", "s", "r0", "e"});
  CHECK(t.at_path("params/Dense_0/kernel").array().to_vector() == std::vector<float>{0, 1, 2, 3, 4, 5});
  CHECK(t.at_path("params/Dense_0/kernel").array().shape() == Shape{2, 3});
  CHECK(t.at_path("params/Dense_0/bias").array().to_vector_i32() == std::vector<std::int32_t>{1, -2, 3});
  CHECK(t.at("s").array().shape() == Shape{});  // ext 3 (numpy scalar) -> rank-0 array
  CHECK(t.at("s").array().item() == 2.5f);
  CHECK(t.at("r0").array().item() == 7.0f);
  CHECK(t.at("e").empty());

  // Writing gives Flax's bytes back, except that Linum has no scalar type: "s" comes out as a rank-0
  // ndarray (ext 1), exactly like "r0".
  Bytes expected = flax;
  Bytes mine = ser::to_msgpack(t);
  std::size_t pos = 0;
  for (; pos + 3 < flax.size(); ++pos)
    if (flax[pos] == 0xa1 && flax[pos + 1] == 0x73 && flax[pos + 2] == 0xd8 && flax[pos + 3] == 0x03) break;
  REQUIRE(pos + 3 < flax.size());
  expected[pos + 3] = 0x01;
  CHECK(mine == expected);
}

TEST_CASE("msgpack: other Flax dtypes are converted when lossless") {
  // Python: {"k": np.zeros((1, 2), np.float64), "b": np.array([True, False]),
  //          "h": np.array([1.5, -0.0], np.float16), "i": np.array([2**31 - 1], np.int64)}
  Bytes flax = hex_bytes(
      "84a16bc71e0193920102a7666c6f61743634c41000000000000000000000000000000000a162c70c01939102a4626f6f6cc4020100a168"
      "c71101939102a7666c6f61743136c404003e0080a169c71301939101a5696e743634c408ffffff7f00000000");
  Tree t = ser::from_msgpack(flax);
  CHECK(t.at("k").array().dtype() == DType::f32);
  CHECK(t.at("k").array().shape() == Shape{1, 2});
  CHECK(t.at("b").array().to_vector_i32() == std::vector<std::int32_t>{1, 0});
  auto h = t.at("h").array().to_vector();
  CHECK(h[0] == 1.5f);
  CHECK(std::signbit(h[1]));
  CHECK(t.at("i").array().to_vector_i32() == std::vector<std::int32_t>{2147483647});

  // A float64 that float32 cannot hold exactly, an int64 beyond int32: errors naming path and dtype.
  auto record = [](std::string_view dtype, const Bytes& data) {
    Bytes inner{0x93, 0x91, 0x01};
    inner.push_back(static_cast<std::uint8_t>(0xa0 | dtype.size()));
    append(inner, dtype);
    inner.push_back(0xc4);
    inner.push_back(static_cast<std::uint8_t>(data.size()));
    append(inner, data);
    Bytes b{0x81, 0xa1, 'w', 0xc7, static_cast<std::uint8_t>(inner.size()), 0x01};
    append(b, inner);
    return b;
  };
  Bytes point_one(8);
  double d = 0.1;
  std::memcpy(point_one.data(), &d, 8);
  std::string msg = error_of([&] { ser::from_msgpack(record("float64", point_one), "ckpt.msgpack"); });
  CHECK(msg.find("cannot load 'ckpt.msgpack': w: float64 value 0.10000000000000001") != std::string::npos);
  CHECK(msg.find("float32") != std::string::npos);
  Bytes big{0, 0, 0, 0x80, 0, 0, 0, 0};  // 2^31
  CHECK(error_of([&] { ser::from_msgpack(record("int64", big)); }).find("w: int64 value 2147483648") != std::string::npos);
  msg = error_of([&] { ser::from_msgpack(record("complex64", Bytes(8))); });
  CHECK(msg.find("w: unsupported dtype 'complex64'") != std::string::npos);
  Bytes bf{0x80, 0x3f};  // bfloat16 1.0
  CHECK(ser::from_msgpack(record("bfloat16", bf)).at("w").array().item() == 1.0f);
}

TEST_CASE("msgpack: nlohmann/json's msgpack writer and reader agree with ours") {
  Tree t = tricky_tree();
  Bytes mine = ser::to_msgpack(t);

  // Build the same document with nlohmann: ext records are binary_t with subtype 1.
  std::function<nlohmann::ordered_json(const Tree&)> build = [&](const Tree& n) -> nlohmann::ordered_json {
    if (n.is_leaf()) {
      const Array& a = n.array();
      nlohmann::ordered_json shape = nlohmann::ordered_json::array();
      for (auto d : a.shape()) shape.push_back(static_cast<std::uint64_t>(d));
      const auto* p = static_cast<const std::uint8_t*>(a.raw());
      nlohmann::ordered_json payload = {shape, dtype_name(a.dtype()),
                                        nlohmann::ordered_json::binary(std::vector<std::uint8_t>(p, p + a.nbytes()))};
      return nlohmann::ordered_json::binary(nlohmann::ordered_json::to_msgpack(payload), 1);
    }
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const auto& [k, v] : n) j[k] = build(v);
    return j;
  };
  CHECK(nlohmann::ordered_json::to_msgpack(build(t)) == mine);

  // nlohmann reads our bytes back as the same document.
  auto parsed = nlohmann::ordered_json::from_msgpack(mine);
  CHECK(parsed == build(t));
  CHECK(parsed["params"]["ints"].get_binary().subtype() == 1);
}

TEST_CASE("msgpack and json: round trips are exact") {
  Tree t = tricky_tree();
  Bytes mp = ser::to_msgpack(t);
  Tree back = ser::from_msgpack(mp);
  CHECK(bitwise_equal(back, t));
  CHECK(diff(t, back).empty());
  CHECK(ser::to_msgpack(back) == mp);
  CHECK(back.at("nested").at("empty").at("inside").empty());

  nlohmann::ordered_json j = ser::to_json(t);
  Tree from_j = ser::from_json(j);
  CHECK(bitwise_equal(from_j, t));
  // Through text, too.
  Tree from_text = ser::from_json(nlohmann::ordered_json::parse(j.dump()));
  CHECK(bitwise_equal(from_text, t));
  // An alphabetically sorted nlohmann::json holds the same data in another order.
  Tree sorted = ser::from_json(nlohmann::json::parse(j.dump()));
  CHECK(diff(t, sorted).empty());
  CHECK(sorted.at("order").keys() == std::vector<std::string>{"a", "m", "z"});

  // The JSON layout, and readable numbers.
  nlohmann::ordered_json small = ser::to_json(Tree{{"w", f32(Shape{2}, {0.1f, std::numeric_limits<float>::infinity()})},
                                                   {"n", Array::from_i32(Shape{1, 1}, {-3})}});
  CHECK(small.dump() == R"({"w":{"shape":[2],"dtype":"float32","data":[0.1,"inf"]},"n":{"shape":[1,1],"dtype":"int32","data":[-3]}})");
  auto specials = ser::to_json(Tree{{"x", Array::from(Shape{4}, std::vector<float>{
                                                          std::numeric_limits<float>::quiet_NaN(), bits_f(0x7fc12345u),
                                                          -std::numeric_limits<float>::infinity(), -0.0f})}});
  CHECK(specials["x"]["data"].dump() == R"x(["nan","nan(0x7fc12345)","-inf",-0.0])x");

  // A leaf at the root.
  Tree leaf = Array::from_i32(Shape{3}, {1, 2, 3});
  CHECK(bitwise_equal(ser::from_msgpack(ser::to_msgpack(leaf)), leaf));
  CHECK(bitwise_equal(ser::from_json(ser::to_json(leaf)), leaf));
  // The empty tree.
  CHECK(ser::to_msgpack(Tree()) == Bytes{0x80});
  CHECK(ser::from_msgpack(Bytes{0x80}).empty());
  CHECK(ser::from_json(ser::to_json(Tree())).empty());
}

TEST_CASE("msgpack: large arrays are chunked the way Flax chunks them, and read back") {
  std::vector<float> v(10);
  for (int i = 0; i < 10; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i);
  Tree t{{"emb", Array::from(Shape{2, 5}, v)}, {"small", Array::scalar(1.0f)}};
  Bytes b = ser::to_msgpack(t, /*max_chunk_bytes=*/16);  // 4 float32 per chunk: chunks of 4, 4, 2
  auto j = nlohmann::ordered_json::from_msgpack(b);
  const auto& emb = j["emb"];
  REQUIRE(emb.is_object());
  CHECK(emb.size() == 3);
  CHECK(emb.begin().key() == "__msgpack_chunked_array__");
  CHECK(emb["__msgpack_chunked_array__"] == true);
  CHECK(emb["shape"].dump() == R"({"0":2,"1":5})");
  CHECK(emb["chunks"].size() == 3);
  CHECK(emb["chunks"]["2"].get_binary().subtype() == 1);
  CHECK(j["small"].is_binary());  // 4 bytes: not chunked

  Tree back = ser::from_msgpack(b);
  CHECK(bitwise_equal(back, t));

  // Corrupt chunked records are errors.
  auto tamper = [&](auto&& edit) {
    auto doc = nlohmann::ordered_json::from_msgpack(b);
    edit(doc["emb"]);
    return nlohmann::ordered_json::to_msgpack(doc);
  };
  CHECK(error_of([&] { ser::from_msgpack(tamper([](auto& e) { e["shape"]["1"] = 6; })); })
            .find("emb: chunked array of shape (2, 6) needs 12 elements, the chunks hold 10") != std::string::npos);
  CHECK_THROWS_AS(ser::from_msgpack(tamper([](auto& e) { e["chunks"].erase("1"); })), IoError);
  CHECK_THROWS_AS(ser::from_msgpack(tamper([](auto& e) { e["shape"].erase("0"); })), IoError);
  CHECK_THROWS_AS(ser::from_msgpack(tamper([](auto& e) { e["__msgpack_chunked_array__"] = false; })), IoError);
  CHECK_THROWS_AS(ser::from_msgpack(tamper([](auto& e) { e["extra"] = 1; })), IoError);
}

TEST_CASE("msgpack: a tree using the key that marks chunked arrays is refused on save, not written unreadable") {
  // (Found by fuzzing: the JSON tree loaded and saved, and the file could not be read back.)
  const Tree t{{"params", Tree{{"__msgpack_chunked_array__", Array::from(Shape{2}, {1, 2})}}}};
  CHECK_THROWS_WITH_AS(ser::to_msgpack(t),
                       doctest::Contains("to_msgpack: the key '__msgpack_chunked_array__' at "
                                         "'params/__msgpack_chunked_array__' is reserved by the MessagePack variable format"),
                       ValueError);
  // JSON has no such mark: the same tree round-trips there.
  CHECK(bitwise_equal(ser::from_json(ser::to_json(t)), t));
}

TEST_CASE("msgpack: malformed input gives IoError naming the entry") {
  auto load = [](const Bytes& b) { return error_of([&] { ser::from_msgpack(b, "model.msgpack"); }); };
  auto leaf_record = [](const Bytes& inner) {
    Bytes b{0x81, 0xa6};
    append(b, "params");
    append(b, Bytes{0x81, 0xa7});
    append(b, "Dense_0");
    append(b, Bytes{0x81, 0xa6});
    append(b, "kernel");
    b.push_back(0xc7);
    b.push_back(static_cast<std::uint8_t>(inner.size()));
    b.push_back(0x01);
    append(b, inner);
    return b;
  };
  auto inner_with = [](const Bytes& shape, std::string_view dtype, std::size_t nbytes) {
    Bytes in{0x93};
    append(in, shape);
    in.push_back(static_cast<std::uint8_t>(0xa0 | dtype.size()));
    append(in, dtype);
    in.push_back(0xc4);
    in.push_back(static_cast<std::uint8_t>(nbytes));
    in.insert(in.end(), nbytes, 0);
    return in;
  };

  CHECK(load(leaf_record(inner_with({0x92, 0x02, 0x03}, "float32", 20))) ==
        "cannot load 'model.msgpack': params/Dense_0/kernel: shape (2, 3) needs 24 bytes of float32 data, found 20");
  CHECK(load(leaf_record(inner_with({0x92, 0x02, 0xff}, "float32", 0))).find("params/Dense_0/kernel: a shape dimension is negative (-1)") != std::string::npos);
  CHECK(load(leaf_record(inner_with({0x91, 0x02}, "float128", 32))).find("params/Dense_0/kernel: unsupported dtype 'float128'") != std::string::npos);
  CHECK(load(leaf_record(inner_with({0x91, 0xc0}, "float32", 0))).find("must be an integer, found nil") != std::string::npos);
  // A lying shape: 2^62 elements is "too large", not an allocation.
  CHECK(load(leaf_record(inner_with({0x92, 0xcf, 0x40, 0, 0, 0, 0, 0, 0, 0, 0x04}, "float32", 0))).find("too large") != std::string::npos);
  CHECK(load(leaf_record(inner_with({0x92, 0xcf, 0x00, 0, 0, 0, 0x40, 0, 0, 0, 0x01}, "float32", 0))).find("needs 4294967296 bytes of float32 data, found 0") != std::string::npos);
  CHECK(load(leaf_record(inner_with({0x99, 1, 1, 1, 1, 1, 1, 1, 1, 1}, "float32", 4))).find("rank 9") != std::string::npos);

  // Unknown ext code; non-string key; a value that is not a map or array; trailing bytes.
  Bytes inner5 = inner_with({0x91, 0x01}, "float32", 4);
  Bytes ext5 = leaf_record(inner5);
  REQUIRE(ext5[ext5.size() - inner5.size() - 1] == 0x01);
  ext5[ext5.size() - inner5.size() - 1] = 0x05;  // the ext type byte
  CHECK(load(ext5).find("params/Dense_0/kernel: unknown msgpack ext type 5") != std::string::npos);
  CHECK(load(Bytes{0x81, 0x01, 0x80}).find("map key at byte 1 is a unsigned int; tree keys must be strings") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xa1, 'x', 0x2a}).find("x: found a msgpack unsigned int") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xa1, 'x', 0x90}).find("x: found a msgpack array") != std::string::npos);
  CHECK(load(Bytes{0x80, 0x00}).find("1 unexpected bytes after the end") != std::string::npos);
  CHECK(load(Bytes{0x82, 0xa1, 'x', 0x80, 0xa1, 'x', 0x80}).find("duplicate key 'x'") != std::string::npos);
  // A key holding a path (Flax's nn.WeightNorm: "Dense_1/kernel/scale") is nested; parts must be non-empty.
  CHECK(ser::from_msgpack(Bytes{0x82, 0xa1, 'a', 0x80, 0xa3, 'a', '/', 'b', 0x80}).contains_path("a/b"));
  CHECK(load(Bytes{0x81, 0xa3, 'a', '/', '/', 0x80}).find("empty part") != std::string::npos);
  CHECK(load(Bytes{0x82, 0xa3, 'a', '/', 'b', 0x80, 0xa3, 'a', '/', 'b', 0x80}).find("names a path that other keys") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xa0, 0x80}).find("empty map key") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xa2, 0xc3, 0x28, 0x80}).find("is not valid UTF-8") != std::string::npos);
  CHECK(ser::from_msgpack(Bytes{0x81, 0xa2, 0xc3, 0xbc, 0x80}).contains("\xc3\xbc"));
  CHECK(load(Bytes{0xc1}).find("invalid msgpack byte 0xc1") != std::string::npos);
  CHECK(load(Bytes{}).find("empty") != std::string::npos);
  // Lying lengths: a map of 2^32-1 entries, a bin / ext / str of 4 GiB in a tiny input.
  CHECK(load(Bytes{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'x'}).find("declares 4294967295 entries") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xa1, 'x', 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}).find("declares 4294967295 bytes") != std::string::npos);
  CHECK(load(Bytes{0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'}).find("declares 4294967295 bytes") != std::string::npos);
  // Deep nesting is refused, not recursed into until the stack overflows.
  Bytes deep;
  for (int i = 0; i < 100000; ++i) deep.insert(deep.end(), {0x81, 0xa1, 'a'});
  deep.push_back(0x80);
  CHECK(load(deep).find("nesting deeper than") != std::string::npos);
}

TEST_CASE("msgpack: every truncation of a valid file is an IoError") {
  Tree t{{"params", {{"Dense_0", {{"kernel", Array::arange(6).with_shape(Shape{2, 3})}, {"bias", Array::zeros(Shape{3})}}}}},
         {"step", Array::from_i32(Shape{}, {3})},
         {"chunky", Array::arange(9)}};
  Bytes full = ser::to_msgpack(t, 8);
  REQUIRE(ser::from_msgpack(full).size() == 3);
  int errors = 0;
  for (std::size_t n = 0; n < full.size(); ++n) {
    Bytes prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    try {
      ser::from_msgpack(prefix);
    } catch (const IoError&) {
      ++errors;
    }
  }
  CHECK(errors == static_cast<int>(full.size()));
}

TEST_CASE("msgpack and json: random corruption never crashes") {
  Tree t = mlp_vars();
  t.set_path("params/chunked", Array::arange(12));
  Bytes full = ser::to_msgpack(t, 16);
  std::mt19937 rng(1234);
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    Bytes b = full;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      std::size_t at = rng() % b.size();
      if (rng() % 2)
        b[at] = static_cast<std::uint8_t>(rng());
      else
        b[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
    }
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    try {
      Tree r = ser::from_msgpack(b);
      ++loaded;
      (void)param_count(r);
    } catch (const IoError&) {
      ++rejected;
    }
  }
  CHECK(loaded + rejected == 20000);
  CHECK(rejected > 0);
  CHECK(loaded > 0);  // flips inside float data are still valid files

  // Pure noise.
  for (int iter = 0; iter < 5000; ++iter) {
    Bytes b(rng() % 64);
    for (auto& x : b) x = static_cast<std::uint8_t>(rng());
    try {
      ser::from_msgpack(b);
    } catch (const IoError&) {
    }
  }

  // JSON text: every truncation fails to load; structural damage gives IoError.
  fs::path dir = fresh_dir("jsoncorrupt");
  fs::path p = dir / "v.json";
  ser::save(p, t);
  Bytes text = file_bytes(p);
  int json_errors = 0;
  for (std::size_t n = 0; n + 1 < text.size(); n += 7) {
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(text.data()), static_cast<std::streamsize>(n));
    try {
      ser::load(p);
    } catch (const IoError&) {
      ++json_errors;
    }
  }
  CHECK(json_errors == static_cast<int>((text.size() - 2) / 7 + 1));
  for (int iter = 0; iter < 2000; ++iter) {
    Bytes b = text;
    b[rng() % b.size()] = static_cast<std::uint8_t>(rng());
    std::string s(b.begin(), b.end());
    try {
      ser::from_json(nlohmann::ordered_json::parse(s, nullptr, /*allow_exceptions=*/false));
    } catch (const IoError&) {
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("json: malformed documents give IoError naming the entry") {
  auto load = [](std::string_view text) {
    return error_of([&] { ser::from_json(nlohmann::ordered_json::parse(text), "v.json"); });
  };
  CHECK(load(R"({"a": {"w": {"shape": [2, 3], "dtype": "float32", "data": [1, 2, 3, 4, 5]}}})") ==
        "cannot load 'v.json': a/w: shape (2, 3) needs 6 elements of float32 data, found 5");
  CHECK(load(R"({"w": {"shape": [-1], "dtype": "float32", "data": []}})").find("w: \"shape\" has a negative dimension -1") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "float64", "data": [1]}})").find("w: unsupported dtype \"float64\"") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "int32", "data": [1.5]}})").find("w: data[0] is a JSON number") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "int32", "data": [4294967296]}})").find("does not fit in int32") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "float32", "data": ["banana"]}})").find("w: data[0] is the string \"banana\"") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "float32", "data": [1e300]}})").find("outside the float32 range") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "float32", "data": [1], "extra": 0}})").find("unexpected field 'extra'") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [4611686018427387904, 4], "dtype": "float32", "data": []}})").find("too large") != std::string::npos);
  CHECK(load(R"({"w": [1, 2]})").find("w: found a JSON array") != std::string::npos);
  CHECK(load(R"({"a/b": {}})").find("contains '/'") != std::string::npos);
  CHECK(load(R"({"w": {"shape": [1], "dtype": "float32"}})").find("needs \"shape\", \"dtype\" and \"data\"") != std::string::npos);
  // A dict entry named "dtype" holds an object, so it is not mistaken for an array.
  Tree odd = ser::from_json(nlohmann::ordered_json::parse(R"({"dtype": {"shape": {}}})"));
  CHECK(odd.at("dtype").at("shape").empty());
  // Hand-written decimals round to the nearest float.
  CHECK(ser::from_json(nlohmann::ordered_json::parse(R"({"w": {"shape": [], "dtype": "float32", "data": [0.1]}})"))
            .at("w").array().item() == 0.1f);
}

// =================================================================================================
// Files
// =================================================================================================

TEST_CASE("files: save and load by extension, atomically") {
  fs::path dir = fresh_dir("files");
  Tree t = tricky_tree();
  ser::save(dir / "vars.msgpack", t);
  ser::save(dir / "vars.json", t);
  CHECK(dir_entries(dir) == std::vector<std::string>{"vars.json", "vars.msgpack"});
  CHECK(bitwise_equal(ser::load(dir / "vars.msgpack"), t));
  CHECK(bitwise_equal(ser::load(dir / "vars.json"), t));
  CHECK(file_bytes(dir / "vars.msgpack") == ser::to_msgpack(t));
  CHECK(bitwise_equal(ser::load_json(dir / "vars.json"), t));
  CHECK(bitwise_equal(ser::load_msgpack(dir / "vars.msgpack"), t));

  // The JSON file is readable: one leaf per line.
  ser::save_json(dir / "small.json", mlp_vars());
  std::ifstream in(dir / "small.json");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  CHECK(text.find("{\n  \"params\": {\n    \"Dense_0\": {\n      \"kernel\": {\"shape\":[2,3],\"dtype\":\"float32\",\"data\":[0.0,1.0,2.0,3.0,4.0,5.0]},") == 0);

  // Overwriting replaces the content.
  Tree small{{"x", Array::scalar(1.0f)}};
  ser::save(dir / "vars.msgpack", small);
  CHECK(bitwise_equal(ser::load(dir / "vars.msgpack"), small));

  CHECK(error_of([&] { ser::save(dir / "vars.bin", t); }).find("unknown extension '.bin'") != std::string::npos);
  CHECK_THROWS_AS(ser::load(dir / "vars.txt"), IoError);
  CHECK(error_of([&] { ser::save(dir / "badkey.json", Tree{{"\xff", Tree()}}); }).find("must be valid UTF-8") != std::string::npos);
  CHECK(error_of([&] { ser::load(dir / "missing.msgpack"); }).find("missing.msgpack") != std::string::npos);
  CHECK(error_of([&] { ser::load(dir / "small.json"); }).empty() == false);
  std::ofstream(dir / "bad.json") << "{\"a\": ";
  CHECK(error_of([&] { ser::load(dir / "bad.json"); }).find("cannot load '" + (dir / "bad.json").string() + "': not valid JSON") == 0);
  std::ofstream(dir / "bad.msgpack") << "\x81\xa1";
  CHECK(error_of([&] { ser::load(dir / "bad.msgpack"); }).find("cannot load '" + (dir / "bad.msgpack").string() + "': truncated") == 0);
  CHECK(dir_entries(dir) == std::vector<std::string>{"bad.json", "bad.msgpack", "small.json", "vars.json", "vars.msgpack"});
  fs::remove_all(dir);
}

TEST_CASE("files: a failed write keeps the old file and leaves no temporary file") {
  fs::path dir = fresh_dir("atomic");
  Tree old_tree{{"old", Array::scalar(1.0f)}};
  Tree new_tree = tricky_tree();
  fs::path target = dir / "vars.msgpack";
  ser::save(target, old_tree);
  Bytes old_bytes = file_bytes(target);

  // The target is a directory: the rename fails after the data was written.
  fs::create_directory(dir / "taken.msgpack");
  CHECK(error_of([&] { ser::save(dir / "taken.msgpack", new_tree); }).find("renaming") != std::string::npos);
  CHECK(fs::is_directory(dir / "taken.msgpack"));
  CHECK(dir_entries(dir) == std::vector<std::string>{"taken.msgpack", "vars.msgpack"});

  // The directory does not exist.
  CHECK_THROWS_AS(ser::save(dir / "no" / "such" / "dir.msgpack", new_tree), IoError);

  // The disk "fills up" in the middle of writing (a file-size limit makes write() fail with EFBIG).
  {
    auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit saved{};
    REQUIRE(getrlimit(RLIMIT_FSIZE, &saved) == 0);
    rlimit small = saved;
    small.rlim_cur = 1000;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string msg = error_of([&] { ser::save(target, new_tree); });
    setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    CHECK(msg.find("cannot write '" + target.string() + "': writing:") == 0);
    CHECK(msg.find("previous file (if any) is unchanged") != std::string::npos);
    CHECK(file_bytes(target) == old_bytes);
    CHECK(dir_entries(dir) == std::vector<std::string>{"taken.msgpack", "vars.msgpack"});
  }

  // A read-only directory (only meaningful when not running as root, who may write anyway).
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
  bool can_write = ::access(dir.c_str(), W_OK) == 0;
  if (!can_write) {
    CHECK_THROWS_AS(ser::save(target, new_tree), IoError);
    CHECK(file_bytes(target) == old_bytes);
  }
  fs::permissions(dir, fs::perms::owner_all);
  CHECK(dir_entries(dir) == std::vector<std::string>{"taken.msgpack", "vars.msgpack"});

  // And a successful write replaces the file.
  ser::save(target, new_tree);
  CHECK(bitwise_equal(ser::load(target), new_tree));
  CHECK(dir_entries(dir) == std::vector<std::string>{"taken.msgpack", "vars.msgpack"});
  fs::remove_all(dir);
}

TEST_CASE("files: temporary files of writers killed mid-write are cleaned up by the next save") {
  fs::path dir = fresh_dir("stale_tmp");
  const fs::path stale = dir / ".vars.msgpack.tmp-2147483600-0";          // no such process
  const fs::path fresh_stale = dir / ".vars.msgpack.tmp-2147483601-0";    // no such process, but just written
  const fs::path live = dir / (".vars.msgpack.tmp-" + std::to_string(::getpid()) + "-99");  // a writer still running
  for (const auto& p : {stale, fresh_stale, live}) std::ofstream(p) << "partial";
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::hours(1));
  fs::last_write_time(live, fs::file_time_type::clock::now() - std::chrono::hours(1));
  ser::save(dir / "vars.msgpack", tricky_tree());
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(fresh_stale));  // might belong to a writer in another PID namespace: left for a minute
  CHECK(fs::exists(live));
  CHECK(bitwise_equal(ser::load(dir / "vars.msgpack"), tricky_tree()));
}

namespace {
struct FineTune {  // a backbone and a classification head
  std::int64_t classes = 10;
  Array operator()(Scope& s, const Array& x) const {
    const Array h = relu(s("backbone", nn::Dense{.features = 8}, x));
    return s("head", nn::Dense{.features = classes}, h);
  }
};
}  // namespace

TEST_CASE("restore: strict as Flax's from_state_dict; fine-tuning keeps a new head; floats convert; errors list the paths") {
  const Array x = Array::ones(Shape{2, 4});
  const Tree pretrained = init(FineTune{10}, rng::key(1), x);
  // The same model: every array restored, bitwise.
  const auto same = serialization::restore(init(FineTune{10}, rng::key(3), x), pretrained);
  CHECK(bitwise_equal(same.tree, pretrained));
  CHECK(same.report.complete());
  CHECK(same.report.restored.size() == 4);
  // A head of another size: an error naming it, unless mismatched shapes are skipped.
  const Tree fresh = init(FineTune{3}, rng::key(2), x);
  CHECK_THROWS_WITH_AS(serialization::restore(fresh, pretrained), doctest::Contains("params/head/bias"), ShapeError);
  const auto [tuned, report] = serialization::restore(fresh, pretrained, {.skip_mismatched_shapes = true});
  CHECK(bitwise_equal(tuned.at_path("params/backbone"), pretrained.at_path("params/backbone")));
  CHECK(bitwise_equal(tuned.at_path("params/head"), fresh.at_path("params/head")));
  CHECK(report.mismatched == std::vector<std::string>{"params/head/bias", "params/head/kernel"});
  CHECK(report.str() == "restored 2, shape mismatched 2 (params/head/bias, params/head/kernel)");
  // A file whose head has another name: strict lists both sides; non-strict restores the backbone.
  Tree other = pretrained;
  other.at("params").set("classifier", other.at_path("params/head"));
  other.at("params").erase("head");
  const std::string strict_error = [&] {
    try {
      (void)serialization::restore(pretrained, other);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  CHECK(strict_error.find("missing from it: params/head/bias, params/head/kernel") != std::string::npos);
  CHECK(strict_error.find("not in the target: params/classifier/bias, params/classifier/kernel") != std::string::npos);
  const auto partial = serialization::restore(fresh, other, {.strict = false});
  CHECK(partial.report.missing == std::vector<std::string>{"params/head/bias", "params/head/kernel"});
  CHECK(partial.report.unexpected == std::vector<std::string>{"params/classifier/bias", "params/classifier/kernel"});
  CHECK(bitwise_equal(partial.tree.at_path("params/backbone"), pretrained.at_path("params/backbone")));
  // Into a bf16 model: float32 arrays convert; the structure and key order stay the target's.
  const Tree bf16_target = tree_map([](const Array& a) { return astype(a, DType::bf16); }, fresh);
  const auto in_bf16 = serialization::restore(bf16_target, pretrained, {.skip_mismatched_shapes = true});
  CHECK(in_bf16.tree.at_path("params/backbone/kernel").array().dtype() == DType::bf16);
  CHECK(in_bf16.tree.at_path("params/backbone/kernel").array().bitwise_equal(
      astype(pretrained.at_path("params/backbone/kernel").array(), DType::bf16)));
  CHECK(flatten(in_bf16.tree).front().first == flatten(fresh).front().first);
  // An int32 leaf takes int32 only; a leaf where the other tree has a dict is an error.
  const Tree ints{{"step", Array::full_i32(Shape{}, 3)}};
  CHECK_THROWS_WITH_AS(serialization::restore(ints, Tree{{"step", Array::zeros(Shape{})}}), doctest::Contains("only float"), ShapeError);
  CHECK_THROWS_WITH_AS(serialization::restore(pretrained, Tree{{"params", Array::zeros(Shape{1})}}), doctest::Contains("dict in the target"),
                       ValueError);
}
