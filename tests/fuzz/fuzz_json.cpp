// Fuzz target: variable files in Linum's JSON layout, read with serialization::from_json.
// Properties: text that is not JSON is refused by the parser; JSON that is not a variable file is
// refused with linum::IoError only; a file that loads writes back (JSON and MessagePack) to one
// that loads to bitwise the same tree, unless MessagePack refuses a key it reserves (then on save,
// with a ValueError saying so, never as a file that cannot be read back).
#include "fuzz_common.hpp"

#include <linum/core/memory.hpp>
#include <linum/train/io/serialization.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace linum;
  memory::LiveLimitScope cap(fuzz::kLiveLimitBytes);
  const auto json = nlohmann::ordered_json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return 0;
  Tree tree;
  try {
    tree = serialization::from_json(json, "fuzz.json");
  } catch (const IoError&) {
    return 0;
  }
  const Tree again = serialization::from_json(nlohmann::ordered_json::parse(serialization::to_json(tree).dump()),
                                              "rewritten.json");
  if (!fuzz::same_bits(tree, again)) fuzz::fail("json -> tree -> json text -> tree changed the tree");
  std::vector<std::uint8_t> packed;
  try {
    packed = serialization::to_msgpack(tree);
  } catch (const ValueError& e) {  // a key the MessagePack format reserves: refused on save, never a bad file
    if (std::string(e.what()).find("is reserved by the MessagePack variable format") == std::string::npos) throw;
    return 0;
  }
  const Tree via_msgpack = serialization::from_msgpack(packed, "rewritten.msgpack");
  if (!fuzz::same_bits(tree, via_msgpack)) fuzz::fail("json -> tree -> msgpack -> tree changed the tree");
  return 0;
}
