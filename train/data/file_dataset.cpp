#include <linum/train/data/file_dataset.hpp>

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/files.hpp>
#include <linum/core/warnings.hpp>
#include <linum/train/io/safetensors.hpp>
#include <linum/train/io/safetensors_internal.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <exception>
#include <iomanip>
#include <map>
#include <sstream>
#include <utility>

namespace linum::datasets {
namespace {

using linum::detail::cat;
using safetensors::internal::Entry;
namespace st = safetensors::internal;
using serialization::internal::FileDType;

constexpr const char* kFormat = "linum.file_dataset";
constexpr int kVersion = 1;

const char* file_dtype_of(DType t) { return t == DType::f32 ? "F32" : t == DType::bf16 ? "BF16" : "I32"; }

std::string shape_str(const std::vector<std::int64_t>& dims) { return serialization::internal::dims_str(dims); }

std::int64_t product(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (std::int64_t d : dims) n *= d;
  return n;
}

// The shard names of an index: NAME-00000.safetensors beside NAME.json.
std::string shard_name(const std::filesystem::path& index, std::size_t k) {
  std::ostringstream s;
  s << index.stem().string() << '-' << std::setw(5) << std::setfill('0') << k << ".safetensors";
  return s.str();
}

// Reads exactly `count` bytes at `offset`, or says the file came up short.
void read_exactly(int fd, std::uint64_t offset, std::size_t count, void* dst, const std::string& source) {
  auto* out = static_cast<std::uint8_t*>(dst);
  while (count > 0) {
    const ssize_t got = ::pread(fd, out, count, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IoError(cat("FileDataset: cannot read ", source, ": ", std::strerror(errno)));
    }
    if (got == 0)
      throw IoError(cat("FileDataset: ", source, " ends at byte ", offset, ", before the records asked for: the file was "
                        "truncated or replaced after the dataset was opened; open it again"));
    out += got;
    offset += static_cast<std::uint64_t>(got);
    count -= static_cast<std::size_t>(got);
  }
}

}  // namespace

struct FileDataset::Impl {
  struct Shard {
    std::string path;
    int fd = -1;
    std::int64_t records = 0;
    std::uint64_t data_offset = 0;  // where the data section starts (8 + header length)
    std::vector<Entry> columns;     // in the dataset's column order
  };
  std::vector<ColumnSpec> columns;
  std::vector<std::int64_t> record_elements;  // per column
  std::vector<Shard> shards;
  std::vector<std::int64_t> starts;  // shard k's first record
  std::int64_t records = 0;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    for (const Shard& s : shards)
      if (s.fd >= 0) ::close(s.fd);
  }

  // Opens a shard and checks its header: with `expected` columns, exactly those (names, file
  // dtypes, record shapes); without, the shard's own tensors become the columns.
  void add_shard(const std::filesystem::path& path, bool define_columns) {
    Shard s;
    s.path = path.string();
    s.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (s.fd < 0) throw IoError(cat("FileDataset: cannot open shard ", s.path, ": ", std::strerror(errno)));
    shards.push_back(s);  // closed by the destructor from here on
    struct stat info {};
    if (::fstat(s.fd, &info) != 0 || !S_ISREG(info.st_mode)) throw IoError(cat("FileDataset: ", s.path, " is not a regular file"));
    const auto file_size = static_cast<std::uint64_t>(info.st_size);
    std::uint8_t first[8] = {};
    if (file_size >= 8) read_exactly(s.fd, 0, 8, first, s.path);
    const std::uint64_t n = st::header_length(std::span<const std::uint8_t>(first, file_size >= 8 ? 8 : 0), file_size, s.path);
    std::string text(static_cast<std::size_t>(n), '\0');
    read_exactly(s.fd, 8, text.size(), text.data(), s.path);
    st::Layout layout = st::parse_header(text, file_size - 8 - n, s.path);
    shards.back().data_offset = 8 + n;
    if (layout.entries.empty()) throw IoError(cat("FileDataset: shard ", s.path, " holds no tensor; a shard holds one per column"));
    for (const Entry& e : layout.entries)
      if (e.dims.empty())
        throw IoError(cat("FileDataset: tensor '", e.name, "' of ", s.path,
                          " is a scalar; every column needs a leading record axis ([records, ...])"));
    const std::int64_t count = layout.entries.front().dims.front();
    for (const Entry& e : layout.entries)
      if (e.dims.front() != count)
        throw IoError(cat("FileDataset: shard ", s.path, " has ", count, " records in '", layout.entries.front().name, "' but ",
                          e.dims.front(), " in '", e.name, "'; every column of a shard has the same number of records"));
    if (define_columns) {
      for (const Entry& e : layout.entries) {
        columns.push_back(ColumnSpec{e.name, st::array_dtype(e), std::vector<std::int64_t>(e.dims.begin() + 1, e.dims.end()),
                                     st::file_dtype_name(e)});
        record_elements.push_back(product(columns.back().record_shape));
      }
    }
    if (layout.entries.size() != columns.size())
      throw IoError(cat("FileDataset: shard ", s.path, " has ", layout.entries.size(), " tensors but the dataset has ",
                        columns.size(), " columns (", describe_columns(), ")"));
    for (const ColumnSpec& c : columns) {
      auto it = std::find_if(layout.entries.begin(), layout.entries.end(), [&](const Entry& e) { return e.name == c.name; });
      if (it == layout.entries.end())
        throw IoError(cat("FileDataset: shard ", s.path, " has no column '", c.name, "' (the dataset's columns: ", describe_columns(), ")"));
      const std::vector<std::int64_t> record(it->dims.begin() + 1, it->dims.end());
      const std::string file_dtype = st::file_dtype_name(*it);
      if (file_dtype != c.file_dtype || record != c.record_shape)
        throw IoError(cat("FileDataset: column '", c.name, "' of ", s.path, " holds ", file_dtype, " records of shape ",
                          shape_str(record), ", but the dataset's are ", c.file_dtype, " of shape ", shape_str(c.record_shape)));
      shards.back().columns.push_back(*it);
    }
    shards.back().records = count;
    starts.push_back(records);
    records += count;
  }

  std::string describe_columns() const {
    std::string out;
    for (const ColumnSpec& c : columns) out += (out.empty() ? "" : ", ") + c.name + " " + c.file_dtype + shape_str(c.record_shape);
    return out;
  }

  // The records at `indices` (stacked: a leading axis of their count; else one record, no axis).
  Tree read(std::span<const std::int64_t> indices, bool stacked) const {
    const auto k = static_cast<std::int64_t>(indices.size());
    for (std::int64_t i : indices)
      if (i < 0 || i >= records)
        throw ValueError(cat("FileDataset: record ", i, " is out of range; the dataset has ", records, " records"));
    std::vector<Array> outs;
    for (const ColumnSpec& c : columns) {
      std::vector<std::int64_t> dims = c.record_shape;
      if (stacked) dims.insert(dims.begin(), k);
      outs.push_back(Array::empty(Shape(dims), c.dtype));
    }
    std::vector<std::uint8_t> staging;
    for (std::int64_t j = 0; j < k;) {
      // A run of consecutive records within one shard: one read per column.
      const std::int64_t first = indices[static_cast<std::size_t>(j)];
      const auto shard = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), first) - starts.begin() - 1);
      const Shard& s = shards[shard];
      const std::int64_t row = first - starts[shard];
      std::int64_t run = 1;
      while (j + run < k && row + run < s.records && indices[static_cast<std::size_t>(j + run)] == first + run) ++run;
      for (std::size_t c = 0; c < columns.size(); ++c) {
        const Entry& e = s.columns[c];
        const auto elements = static_cast<std::size_t>(record_elements[c] * run);
        const std::size_t bytes = elements * e.dtype->size;
        const std::uint64_t offset = s.data_offset + e.begin + static_cast<std::uint64_t>(row * record_elements[c]) * e.dtype->size;
        auto* dst = static_cast<std::uint8_t*>(outs[c].mutable_raw()) +
                    static_cast<std::size_t>(j * record_elements[c]) * dtype_size(columns[c].dtype);
        const bool same_bytes = std::endian::native == std::endian::little &&
                                (e.dtype->type == FileDType::f32 || e.dtype->type == FileDType::i32 || e.dtype->type == FileDType::bf16);
        if (same_bytes) {
          read_exactly(s.fd, offset, bytes, dst, s.path);
        } else {
          staging.resize(bytes);
          read_exactly(s.fd, offset, bytes, staging.data(), s.path);
          st::read_elements(s.path, e, staging.data(), elements, dst);
        }
      }
      j += run;
    }
    std::vector<std::pair<std::string, Array>> items;
    for (std::size_t c = 0; c < columns.size(); ++c) items.emplace_back(columns[c].name, std::move(outs[c]));
    return unflatten(items);
  }
};

FileDataset::FileDataset(const std::filesystem::path& index) {
  const std::string source = index.string();
  const std::vector<std::uint8_t> bytes = files::read_file(index);
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) -> IoError {
    return IoError(cat("FileDataset: ", source, " is not a dataset index: ", what, " (FileDatasetWriter::close() writes one)"));
  };
  if (j.is_discarded() || !j.is_object()) throw bad("not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat) throw bad(cat("no \"format\": \"", kFormat, "\""));
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int>() != kVersion)
    throw bad(cat("version ", j.contains("version") ? j["version"].dump() : "missing", ", this reader reads version ", kVersion));
  if (!j.contains("columns") || !j["columns"].is_object() || j["columns"].empty()) throw bad("\"columns\" must name the columns");
  if (!j.contains("shards") || !j["shards"].is_array() || j["shards"].empty()) throw bad("\"shards\" must list the shards");
  if (!j.contains("records") || !j["records"].is_number_unsigned()) throw bad("\"records\" must count the records");
  auto impl = std::make_shared<Impl>();
  // The columns in the writer's order (the order of its records' tree); shards are matched by name.
  for (const auto& [name, spec] : j["columns"].items()) {
    if (!spec.is_object() || !spec.contains("dtype") || !spec["dtype"].is_string() || !spec.contains("shape") || !spec["shape"].is_array())
      throw bad(cat("column '", name, "' needs a dtype string and a shape array"));
    ColumnSpec c{name, DType::f32, {}, spec["dtype"].get<std::string>()};
    for (const auto& d : spec["shape"]) {
      if (!d.is_number_unsigned()) throw bad(cat("column '", name, "' has shape ", spec["shape"].dump()));
      c.record_shape.push_back(d.get<std::int64_t>());
    }
    impl->columns.push_back(std::move(c));
    impl->record_elements.push_back(product(impl->columns.back().record_shape));
  }
  for (const auto& shard : j["shards"]) {
    if (!shard.is_object() || !shard.contains("file") || !shard["file"].is_string() || !shard.contains("records") ||
        !shard["records"].is_number_unsigned())
      throw bad(cat("a shard entry needs a file name and a record count, got ", shard.dump()));
    const std::filesystem::path file = shard["file"].get<std::string>();
    if (file.has_parent_path() || file.is_absolute()) throw bad(cat("shard file '", file.string(), "' must be a name beside the index"));
    impl->add_shard(index.parent_path() / file, /*define_columns=*/false);
    if (impl->shards.back().records != shard["records"].get<std::int64_t>())
      throw IoError(cat("FileDataset: shard ", impl->shards.back().path, " holds ", impl->shards.back().records,
                        " records but the index ", source, " says ", shard["records"].get<std::int64_t>(),
                        ": the shard was rewritten after the index; write the dataset again"));
  }
  for (std::size_t c = 0; c < impl->columns.size(); ++c) impl->columns[c].dtype = st::array_dtype(impl->shards.front().columns[c]);
  if (impl->records != j["records"].get<std::int64_t>())
    throw IoError(cat("FileDataset: the shards of ", source, " hold ", impl->records, " records but the index says ",
                      j["records"].get<std::int64_t>()));
  impl_ = std::move(impl);
}

FileDataset FileDataset::from_shards(const std::vector<std::filesystem::path>& shards) {
  if (shards.empty()) throw ValueError("FileDataset::from_shards: give at least one safetensors file");
  auto impl = std::make_shared<Impl>();
  for (std::size_t k = 0; k < shards.size(); ++k) impl->add_shard(shards[k], /*define_columns=*/k == 0);
  return FileDataset(std::shared_ptr<const Impl>(std::move(impl)));
}

std::int64_t FileDataset::size() const { return impl_->records; }
const std::vector<ColumnSpec>& FileDataset::columns() const { return impl_->columns; }
std::int64_t FileDataset::shard_count() const { return static_cast<std::int64_t>(impl_->shards.size()); }

Tree FileDataset::record(std::int64_t i) const {
  const std::int64_t one[1] = {i};
  return impl_->read(one, /*stacked=*/false);
}

Tree FileDataset::gather(std::span<const std::int64_t> indices) const { return impl_->read(indices, /*stacked=*/true); }

FileDatasetWriter::FileDatasetWriter(std::filesystem::path index, FileDatasetWriterOptions options)
    : index_(std::move(index)), options_(options), uncaught_at_construction_(std::uncaught_exceptions()) {
  if (options_.records_per_shard < 1)
    throw ValueError(cat("FileDatasetWriter: records_per_shard must be at least 1, got ", options_.records_per_shard));
  if (index_.extension() != ".json")
    throw ValueError(cat("FileDatasetWriter: the index '", index_.string(), "' should be a .json file; its shards are named after it"));
}

FileDatasetWriter::~FileDatasetWriter() {
  if (closed_ || columns_.empty() || std::uncaught_exceptions() > uncaught_at_construction_) return;
  try {
    close();
  } catch (const std::exception& e) {
    warn(cat("FileDatasetWriter: closing ", index_.string(), " in the destructor failed (", e.what(),
             "); call close() to see such errors where they happen"));
  }
}

void FileDatasetWriter::write(const Tree& records) {
  if (closed_) throw ValueError(cat("FileDatasetWriter::write: ", index_.string(), " is closed; open another writer"));
  if (records.is_leaf()) throw ValueError("FileDatasetWriter::write: give a dict of columns ({\"image\": ..., \"label\": ...})");
  const std::vector<std::pair<std::string, Array>> flat = flatten(records);
  if (flat.empty()) throw ValueError("FileDatasetWriter::write: the records have no column");
  std::int64_t count = -1;
  for (const auto& [name, a] : flat) {
    if (a.shape().rank() == 0)
      throw ValueError(cat("FileDatasetWriter::write: column '", name, "' is a scalar; give records stacked on a leading axis"));
    if (count >= 0 && a.shape()[0] != count)
      throw ValueError(cat("FileDatasetWriter::write: column '", name, "' has ", a.shape()[0], " records but '",
                           flat.front().first, "' has ", count, "; every column needs the same count"));
    count = a.shape()[0];
  }
  if (columns_.empty()) {
    for (const auto& [name, a] : flat) {
      const std::vector<std::int64_t> dims(a.shape().begin(), a.shape().end());
      columns_.push_back(ColumnSpec{name, a.dtype(), std::vector<std::int64_t>(dims.begin() + 1, dims.end()), file_dtype_of(a.dtype())});
    }
    pending_.resize(columns_.size());
  }
  if (flat.size() != columns_.size())
    throw ValueError(cat("FileDatasetWriter::write: the records have ", flat.size(), " columns but the first write had ",
                         columns_.size(), "; every write gives the same columns"));
  std::vector<const Array*> in_order;
  for (const ColumnSpec& c : columns_) {
    auto it = std::find_if(flat.begin(), flat.end(), [&](const auto& p) { return p.first == c.name; });
    if (it == flat.end()) throw ValueError(cat("FileDatasetWriter::write: the records have no column '", c.name, "', which the first write had"));
    const Array& a = it->second;
    const std::vector<std::int64_t> dims(a.shape().begin(), a.shape().end());
    const std::vector<std::int64_t> record(dims.begin() + 1, dims.end());
    if (a.dtype() != c.dtype || record != c.record_shape)
      throw ValueError(cat("FileDatasetWriter::write: column '", c.name, "' has ", dtype_name(a.dtype()), " records of shape ",
                           shape_str(record), " but the first write's were ", dtype_name(c.dtype), " of shape ",
                           shape_str(c.record_shape)));
    in_order.push_back(&a);
  }
  for (std::size_t c = 0; c < columns_.size(); ++c) {
    const auto* bytes = static_cast<const std::uint8_t*>(in_order[c]->raw());
    pending_[c].insert(pending_[c].end(), bytes, bytes + in_order[c]->nbytes());
  }
  pending_records_ += count;
  while (pending_records_ >= options_.records_per_shard) write_shard(options_.records_per_shard);
}

void FileDatasetWriter::write_shard(std::int64_t count) {
  std::vector<std::pair<std::string, Array>> items;
  for (std::size_t c = 0; c < columns_.size(); ++c) {
    std::vector<std::int64_t> dims = columns_[c].record_shape;
    dims.insert(dims.begin(), count);
    Array a = Array::empty(Shape(dims), columns_[c].dtype);
    std::memcpy(a.mutable_raw(), pending_[c].data(), a.nbytes());
    pending_[c].erase(pending_[c].begin(), pending_[c].begin() + static_cast<std::ptrdiff_t>(a.nbytes()));
    items.emplace_back(columns_[c].name, std::move(a));
  }
  safetensors::save(index_.parent_path() / shard_name(index_, shard_records_.size()), unflatten(items), {}, '/');
  shard_records_.push_back(count);
  pending_records_ -= count;
  written_ += count;
}

void FileDatasetWriter::close() {
  if (closed_) return;
  if (columns_.empty())
    throw ValueError(cat("FileDatasetWriter::close: nothing was written to ", index_.string(), "; a dataset needs at least one write"));
  if (pending_records_ > 0 || shard_records_.empty()) write_shard(pending_records_);
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["records"] = written_;
  nlohmann::ordered_json columns = nlohmann::ordered_json::object();
  for (const ColumnSpec& c : columns_) columns[c.name] = {{"dtype", c.file_dtype}, {"shape", c.record_shape}};
  j["columns"] = std::move(columns);
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (std::size_t k = 0; k < shard_records_.size(); ++k) shards.push_back({{"file", shard_name(index_, k)}, {"records", shard_records_[k]}});
  j["shards"] = std::move(shards);
  const std::string text = j.dump(1) + "\n";
  files::write_file_atomic(index_, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
  closed_ = true;
}

}  // namespace linum::datasets
