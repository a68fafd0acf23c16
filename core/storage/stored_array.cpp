#include <linum/core/storage/stored_array.hpp>

#include <linum/core/error.hpp>
#include <linum/core/memory.hpp>

namespace linum::storage {

std::string Placement::str() const {
  if (codec == Codec::none) return where == Where::ram ? "ram" : "disk";
  return (where == Where::disk ? "disk+" : "") + std::string(codec_name(codec));
}

Placement placement_from_string(std::string_view s) {
  Placement p;
  if (s == "ram") return p;
  if (s.starts_with("disk")) {
    p.where = Where::disk;
    s.remove_prefix(4);
    if (s.empty()) return p;
    if (!s.starts_with("+")) s = "?";
    else s.remove_prefix(1);
  }
  try {
    p.codec = codec_from_name(s);
  } catch (const ValueError&) {
    throw ValueError(linum::detail::cat("storage: '", s, "' names no placement; use ram, disk, bf16, int8, fp8_e4m3, or disk+<codec>"));
  }
  return p;
}

// A compressed value (its payload in RAM, or in the spill file).
struct StoredArray::Held {
  Compressed c;
  std::shared_ptr<SpillFile::Entry> entry;  // the payload's place on disk (c.payload undefined then)
  std::int64_t compressed = 0, original = 0;

  Held(Compressed compressed_value, bool to_disk) : c(std::move(compressed_value)) {
    if (c.codec != Codec::none) {
      compressed = static_cast<std::int64_t>(c.payload.nbytes());
      original = c.shape.numel() * static_cast<std::int64_t>(dtype_size(c.dtype));
      memory::detail::on_compressed(compressed, original);
    }
    if (to_disk) {
      entry = spill_file().put(c.payload);
      c.payload = Array();
    }
  }
  ~Held() {
    if (compressed != 0 || original != 0) memory::detail::on_compressed(-compressed, -original);
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
};

StoredArray StoredArray::store(const Array& a, Placement placement) {
  if (!a.defined()) return StoredArray();
  if (placement == Placement{}) return StoredArray(a.detached());
  StoredArray s;
  s.held_ = std::make_shared<const Held>(compress(a.detached(), placement.codec), placement.where == Where::disk);
  return s;
}

Array StoredArray::get() const {
  if (ram_.defined() || held_ == nullptr) return ram_;
  if (held_->entry == nullptr) return decompress(held_->c);
  Compressed c{held_->c.codec, held_->c.shape, held_->c.dtype, held_->entry->read()};
  return decompress(c);
}

void StoredArray::prefetch() const {
  if (held_ != nullptr && held_->entry != nullptr) held_->entry->prefetch();
}

Placement StoredArray::placement() const {
  if (held_ == nullptr) return {};
  return {held_->entry != nullptr ? Where::disk : Where::ram, held_->c.codec};
}

const Shape& StoredArray::shape() const { return held_ != nullptr ? held_->c.shape : ram_.shape(); }
DType StoredArray::dtype() const { return held_ != nullptr ? held_->c.dtype : ram_.dtype(); }

}  // namespace linum::storage
