// Fuzz target: variable files in MessagePack (Flax's layout), read with serialization::from_msgpack.
// Properties: bad bytes are refused with linum::IoError only; bytes that load write back to a
// file that loads to bitwise the same tree, and so does the tree's JSON form.
#include "fuzz_common.hpp"

#include <linum/core/memory.hpp>
#include <linum/train/io/serialization.hpp>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace linum;
  memory::LiveLimitScope cap(fuzz::kLiveLimitBytes);
  Tree tree;
  try {
    tree = serialization::from_msgpack(std::span<const std::uint8_t>(data, size), "fuzz.msgpack");
  } catch (const IoError&) {
    return 0;
  }
  // Small chunks exercise Flax's chunked-array layout on the way back.
  const Tree again = serialization::from_msgpack(serialization::to_msgpack(tree, 64), "rewritten.msgpack");
  if (!fuzz::same_bits(tree, again)) fuzz::fail("msgpack -> tree -> msgpack -> tree changed the tree");
  const Tree via_json = serialization::from_json(serialization::to_json(tree), "rewritten.json");
  if (!fuzz::same_bits(tree, via_json)) fuzz::fail("msgpack -> tree -> json -> tree changed the tree");
  return 0;
}
