// safetensors: a file the reference writer made (tests/data/make_safetensors.py) reads with every
// dtype converted as documented; Linum's files round trip bit for bit, by bytes and by mapping a
// file; every malformed header or data section is an IoError that says what is wrong.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/errors.hpp"
#include "testing/gradcheck.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

using namespace linum;
using linum::testing::contains;
namespace st = linum::safetensors;

namespace {

const std::filesystem::path kReference = std::filesystem::path(LINUM_TEST_DATA_DIR) / "reference.safetensors";

std::vector<float> arange_values(std::int64_t n, double scale, double offset) {
  std::vector<float> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(static_cast<float>(static_cast<double>(i) * scale + offset));
  return v;
}

// A file from a header text and a data section.
std::vector<std::uint8_t> file_of(const std::string& header, const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out(8 + header.size() + data.size());
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + static_cast<std::ptrdiff_t>(header.size()));
  return out;
}

std::string error_of(const std::vector<std::uint8_t>& bytes, const st::LoadOptions& options = {}) {
  try {
    st::from_bytes(bytes, "test.safetensors", options);
  } catch (const IoError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a file the reference safetensors writer made: every dtype, metadata, header order") {
  const st::Contents c = st::load(kReference);
  CHECK(c.metadata.at("format") == "np");
  CHECK(c.metadata.at("written_by") == "safetensors 0.8.0");
  // The tree lists the tensors in the header's order (the reference writer sorts by dtype size).
  const std::vector<std::string> order = c.tensors.keys();
  CHECK(order.front() == "ids");
  CHECK(order.size() == 9);
  const Tree& t = c.tensors;
  CHECK(t.at("encoder.layer.0.weight").array().dtype() == DType::f32);
  CHECK(t.at("encoder.layer.0.weight").array().shape() == Shape{3, 4});
  CHECK(t.at("encoder.layer.0.weight").array().to_vector() == arange_values(12, 0.25, -1.0));
  CHECK(t.at("encoder.layer.0.bias").array().dtype() == DType::bf16);
  CHECK(astype(t.at("encoder.layer.0.bias").array(), DType::f32).to_vector() == arange_values(4, 0.5, -1.0));
  CHECK(t.at("half").array().dtype() == DType::f32);  // F16 read exactly as float32
  CHECK(t.at("half").array().to_vector() == arange_values(6, 0.125, -0.25));
  CHECK(t.at("double").array().to_vector() == arange_values(5, 0.5, 1.0));
  CHECK(t.at("ids").array().to_vector_i32() == std::vector<std::int32_t>{-1500, -500, 500, 1500});
  CHECK(t.at("bytes").array().to_vector_i32() == std::vector<std::int32_t>{0, 40, 80, 120, 160, 200});
  CHECK(t.at("mask").array().to_vector_i32() == std::vector<std::int32_t>{1, 0, 1});
  CHECK(t.at("count").array().shape() == Shape{});
  CHECK(t.at("count").array().to_vector_i32() == std::vector<std::int32_t>{7});
  CHECK(t.at("empty").array().shape() == Shape{0, 3});
  // The same bytes read from memory give the same tree; F16 as bf16 on request; a subset.
  std::ifstream in(kReference, std::ios::binary);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(bitwise_equal(st::from_bytes(bytes).tensors, t));
  const Array half_bf16 = st::from_bytes(bytes, "ref", {.f16_as_bf16 = true}).tensors.at("half").array();
  CHECK(half_bf16.dtype() == DType::bf16);
  CHECK(astype(half_bf16, DType::f32).to_vector() == arange_values(6, 0.125, -0.25));  // exact in bf16 too
  const Tree subset = st::load(kReference, {.names = {"half", "ids"}}).tensors;
  CHECK(subset.keys() == std::vector<std::string>{"ids", "half"});
  CHECK(contains(error_of(bytes, {.names = {"nope"}}), "no tensor named 'nope'"));
  // PyTorch's dotted names nest on request.
  const Tree nested = st::nest_at_dots(t);
  CHECK(nested.at_path("encoder/layer/0/weight").array().bitwise_equal(t.at("encoder.layer.0.weight").array()));
}

TEST_CASE("Linum's safetensors files round trip bit for bit (bytes, and a mapped file written atomically)") {
  const Tree tree{{"params", Tree{{"Dense_0", Tree{{"kernel", linum::testing::random_array(Shape{3, 2}, 1)},
                                                   {"bias", Array::zeros(Shape{2})}}},
                                  {"Embed_0", Tree{{"embedding", astype(linum::testing::random_array(Shape{5, 3}, 2), DType::bf16)}}}}},
                  {"step", Array::from_i32(Shape{}, {3})},
                  {"empty", Array::zeros(Shape{0, 4})}};
  const std::map<std::string, std::string> meta{{"format", "linum"}, {"note", "ünïcode"}};
  const std::vector<std::uint8_t> bytes = st::to_bytes(tree, meta);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<std::uint64_t>(bytes[i]) << (8 * i);
  CHECK(header_len % 8 == 0);  // padded with spaces as the reference writer pads
  const st::Contents back = st::from_bytes(bytes);
  CHECK(back.metadata == meta);
  CHECK(back.tensors.contains("params.Dense_0.kernel"));  // nested keys joined with '.'
  CHECK(bitwise_equal(st::nest_at_dots(back.tensors), tree));
  // With '/' as the separator the nested tree comes back as it was.
  CHECK(bitwise_equal(st::from_bytes(st::to_bytes(tree, {}, '/')).tensors, tree));
  const auto path =
      std::filesystem::temp_directory_path() / ("linum_test_roundtrip_" + std::to_string(::getpid()) + ".safetensors");
  st::save(path, tree, meta);
  CHECK(bitwise_equal(st::nest_at_dots(st::load(path).tensors), tree));
  std::filesystem::remove(path);
  // Writing refuses what a file cannot hold.
  CHECK_THROWS_WITH_AS(st::to_bytes(Tree(Array::zeros(Shape{2}))), doctest::Contains("not a single array"), ValueError);
  CHECK_THROWS_WITH_AS(st::to_bytes(Tree{{"a.b", Array::zeros(Shape{1})}, {"a", Tree{{"b", Array::zeros(Shape{1})}}}}),
                       doctest::Contains("two tensors would both be named 'a.b'"), ValueError);
  CHECK_THROWS_WITH_AS(st::to_bytes(Tree{{"__metadata__", Array::zeros(Shape{1})}}), doctest::Contains("'__metadata__'"),
                       ValueError);
}

TEST_CASE("malformed safetensors files are IoErrors that say what is wrong") {
  const std::vector<std::uint8_t> four(16, 0);  // 4 float32 zeros
  auto one = [](const std::string& entry) { return std::string("{\"t\":") + entry + "}"; };
  CHECK(contains(error_of({1, 2, 3}), "8-byte header length"));
  CHECK(contains(error_of(file_of("{}", {})), "no error"));  // an empty file of tensors is valid
  std::vector<std::uint8_t> huge = file_of("{}", {});
  huge[7] = 0x7f;
  CHECK(contains(error_of(huge), "header length"));
  CHECK(contains(error_of(file_of("[1, 2]", {})), "not a JSON object"));
  CHECK(contains(error_of(file_of("{\"t\": ", {})), "not a JSON object"));
  CHECK(contains(error_of(file_of(std::string("{\"\xff\": 1}"), {})), "not UTF-8"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[4]}"), four)), "has no 'data_offsets'"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,16]}"), four)),
                 "dtype 'F8_E4M3', which Linum does not read"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}"), four)),
                 "non-negative integers"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[0,16]}"), four)),
                 "needs 5 x 4 bytes"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,0]}"), four)),
                 "end before they begin"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,16]}"), four)),
                 "overflows"));
  // The tensors must tile the data: no gap, no overlap, nothing after them, nothing missing.
  CHECK(contains(error_of(file_of("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                  "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}", four)),
                 "begins at 12, but the data before it ends at 8"));
  CHECK(contains(error_of(file_of("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
                                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", four)),
                 "no gap or overlap"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}"), four)),
                 "cover 12 bytes of data but the file holds 16"));
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,32]}"), four)),
                 "cover 32 bytes of data but the file holds 16"));
  // Lossy conversions are refused, naming the tensor.
  std::vector<std::uint8_t> big_i64(8, 0);
  big_i64[4] = 1;  // 2^32
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}"), big_i64)), "tensor 't'"));
  std::vector<std::uint8_t> third(8);
  const double d = 1.0 / 3.0;
  std::memcpy(third.data(), &d, 8);
  CHECK(contains(error_of(file_of(one("{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}"), third)), "tensor 't'"));
  // Metadata holds strings only; names must fit a tree.
  CHECK(contains(error_of(file_of("{\"__metadata__\":{\"k\":1}}", {})), "must be a string"));
  CHECK(contains(error_of(file_of("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                                  "\"a/b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[4,16]}}", four)),
                 "cannot be placed in a tree"));
  // A file that cannot be opened.
  CHECK_THROWS_WITH_AS(st::load("/nonexistent/x.safetensors"), doctest::Contains("cannot open"), IoError);
}
