// datasets::DataSource: what a DataLoader batches. Any type with
//
//   std::int64_t size() const;                                   // the number of records
//   Tree gather(std::span<const std::int64_t> indices) const;    // those records, stacked on a new leading axis
//
// is one (grain's RandomAccessDataSource, PyTorch's map-style Dataset): an ArrayDataset (records in
// memory), a FileDataset (records in files, read as batches ask for them), or a user's own type
// that decodes images, tokenizes text or generates samples. A DataSource holds it by shared
// pointer, so copies are cheap and see the same records.
//
//   struct Squares {  // record i: {"x": i, "y": i * i}
//     std::int64_t size() const { return 1000; }
//     Tree gather(std::span<const std::int64_t> idx) const { ... }
//   };
//   datasets::DataLoader loader(Squares{}, {.batch_size = 32, .workers = 2});
//
// gather() may be called from several threads at once (the loader's workers): it must not modify
// shared state without locking. It must return a dict of arrays whose leading dimension is the
// number of indices, every index in [0, size()) (the loader asks for no other).
#pragma once

#include <linum/core/tree.hpp>

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

namespace linum::datasets {

template <class S>
concept RandomAccessRecords = requires(const S& s, std::span<const std::int64_t> indices) {
  { s.size() } -> std::convertible_to<std::int64_t>;
  { s.gather(indices) } -> std::convertible_to<Tree>;
};

class DataSource {
 public:
  DataSource() = default;
  template <RandomAccessRecords S>
    requires(!std::same_as<std::remove_cvref_t<S>, DataSource>)
  DataSource(S source)  // NOLINT(google-explicit-constructor): any source converts, as a std::function does
      : impl_(std::make_shared<const Holder<S>>(std::move(source))) {}

  std::int64_t size() const { return impl_ ? impl_->size() : 0; }
  Tree gather(std::span<const std::int64_t> indices) const { return impl_ ? impl_->gather(indices) : Tree{}; }
  // The source's own object when it is an S, else null (the loader's dataset, seen as what it is).
  template <class S>
  const S* get() const {
    const auto* h = dynamic_cast<const Holder<S>*>(impl_.get());
    return h != nullptr ? &h->source : nullptr;
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual std::int64_t size() const = 0;
    virtual Tree gather(std::span<const std::int64_t> indices) const = 0;
  };
  template <class S>
  struct Holder final : Base {
    explicit Holder(S s) : source(std::move(s)) {}
    std::int64_t size() const override { return static_cast<std::int64_t>(source.size()); }
    Tree gather(std::span<const std::int64_t> indices) const override { return source.gather(indices); }
    S source;
  };
  std::shared_ptr<const Base> impl_;
};

}  // namespace linum::datasets
