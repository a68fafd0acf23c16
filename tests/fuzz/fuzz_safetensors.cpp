// Fuzz target: safetensors files, read with safetensors::from_bytes (F16 as float32 and as bf16).
// Properties: bad bytes are refused with linum::IoError only; bytes that load write back (nested
// keys joined with '/', as the tensor names were) to bytes that load to bitwise the same tree and
// metadata.
#include "fuzz_common.hpp"

#include <linum/core/memory.hpp>
#include <linum/train/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace linum;
  memory::LiveLimitScope cap(fuzz::kLiveLimitBytes);
  const std::span<const std::uint8_t> bytes(data, size);
  safetensors::Contents c;
  try {
    c = safetensors::from_bytes(bytes, "fuzz.safetensors");
    (void)safetensors::from_bytes(bytes, "fuzz.safetensors", {.f16_as_bf16 = true});
  } catch (const IoError&) {
    return 0;
  }
  safetensors::Contents again;
  try {
    again = safetensors::from_bytes(safetensors::to_bytes(c.tensors, c.metadata, '/'), "rewritten.safetensors");
  } catch (const ValueError&) {
    // A tree to_bytes refuses: only a tensor named "__metadata__" inside a nested dict could give one.
    return 0;
  }
  if (!fuzz::same_bits(c.tensors, again.tensors)) fuzz::fail("safetensors -> tree -> safetensors -> tree changed the tree");
  if (c.metadata != again.metadata) fuzz::fail("safetensors -> tree -> safetensors changed the metadata");
  return 0;
}
