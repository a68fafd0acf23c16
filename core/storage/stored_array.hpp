// A value kept for later: in RAM as it is, compressed, in the spill file, or compressed in the
// spill file. Checkpoint policies and residual scopes (lift/) keep residuals this way.
//
//   StoredArray s = StoredArray::store(x, {.where = Where::disk});   // x goes to the spill file
//   Array back = s.get();                                           // bit for bit x
//   StoredArray c = StoredArray::store(x, {.codec = Codec::int8});   // 1 byte per element in RAM
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/storage/compression.hpp>
#include <linum/core/storage/spill_file.hpp>

#include <memory>
#include <string>

namespace linum::storage {

enum class Where : std::uint8_t { ram, disk };

// Where a value lives and how it is encoded. Lossless unless the codec is not none.
struct Placement {
  Where where = Where::ram;
  Codec codec = Codec::none;
  bool lossless() const { return codec == Codec::none; }
  // "ram", "disk", "int8", "disk+int8".
  std::string str() const;
  friend bool operator==(const Placement&, const Placement&) = default;
};
// The placement a str() names; ValueError otherwise.
Placement placement_from_string(std::string_view s);

class StoredArray {
 public:
  StoredArray() = default;
  // `a` kept in RAM as it is.
  explicit StoredArray(Array a) : ram_(std::move(a)) {}
  // `a` kept as `placement` says (disk: the process's spill file, storage::spill_file()).
  static StoredArray store(const Array& a, Placement placement);

  bool defined() const { return ram_.defined() || held_ != nullptr; }
  // The value (decompressed, read back): the stored array's shape and dtype.
  Array get() const;
  // For a value in the spill file: starts reading it back now (get() then finds it in RAM).
  void prefetch() const;
  // The array itself when it is kept in RAM uncompressed (null otherwise).
  const Array* in_ram() const { return ram_.defined() ? &ram_ : nullptr; }
  Placement placement() const;
  const Shape& shape() const;
  DType dtype() const;

 private:
  struct Held;
  Array ram_;
  std::shared_ptr<const Held> held_;
};

}  // namespace linum::storage
