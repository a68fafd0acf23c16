// SHA-1 (FIPS 180-4), needed to derive keys exactly as Flax does (it hashes module paths with
// hashlib.sha1). Not for security.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace linum::rng {

// Incremental SHA-1: update() any number of times, then digest() once.
class Sha1 {
 public:
  Sha1();
  // Appends bytes to the message.
  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // The 20-byte digest of everything appended so far. Finalizes: call it once.
  std::array<std::uint8_t, 20> digest();

 private:
  void block(const std::uint8_t* p);

  std::array<std::uint32_t, 5> h_;
  std::array<std::uint8_t, 64> buf_{};
  std::size_t buf_len_ = 0;
  std::uint64_t total_len_ = 0;
};

}  // namespace linum::rng
