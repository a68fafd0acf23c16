// datasets::FileDataset: records kept in files and read when a batch asks for them, for datasets
// larger than memory (what grain's ArrayRecordDataSource, a TFRecord dataset or a memory-mapped
// NumPy array give Python users). Only the rows a batch needs are read; nothing else is held.
//
//   datasets::FileDatasetWriter w("/data/train.json", {.records_per_shard = 8192});
//   for (...) w.write(Tree{{"image", images}, {"label", labels}});    // images [B, 28, 28, 1], labels [B]
//   w.close();
//
//   datasets::FileDataset train("/data/train.json");                   // reads the index and headers only
//   datasets::DataLoader loader(train, {.batch_size = 128, .workers = 2});
//
// Format: an index file NAME.json and shards NAME-00000.safetensors, NAME-00001.safetensors, ...
// beside it. A shard is an ordinary safetensors file (safetensors.hpp; Python reads one with
// safetensors.numpy.load_file) whose tensors are the columns, each [records in the shard, ...the
// record's shape]; the dataset's records are the shards' records in order. The index lists the
// columns and the shards:
//   {"format": "linum.file_dataset", "version": 1, "records": 70000,
//    "columns": {"image": {"dtype": "F32", "shape": [28, 28, 1]}, "label": {"dtype": "I32", "shape": []}},
//    "shards": [{"file": "train-00000.safetensors", "records": 8192}, ...]}
// Nested columns are named by their tree paths ("inputs/ids").
//
// Writing: FileDatasetWriter takes records in batches of any size, writes a shard (atomically)
// each time records_per_shard have come in, so it holds at most one shard's records; close()
// writes the last shard and then the index (atomically), so a dataset whose writer did not finish
// has no index and cannot be opened as complete. The destructor closes a writer that was not
// closed, except while an exception unwinds the stack (then it writes no index).
//
// Reading: opening reads the index and each shard's header and checks them against each other
// (IoError naming the file and what differs). gather() reads each run of consecutive records of a
// shard with one pread per column, converts file dtypes as safetensors::load does (F16 to f32,
// small integers to i32, ...), and may run on several threads at once. A shard truncated or
// replaced after opening is an IoError naming it when a read comes up short, never a crash.
// FileDataset::from_shards opens safetensors files written elsewhere (no index: their headers give
// the record counts, the first file the columns).
#pragma once

#include <linum/core/dtype.hpp>
#include <linum/core/tree.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace linum::datasets {

// One column: its tree path, the dtype its arrays have, a record's shape, and the file's dtype.
struct ColumnSpec {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> record_shape;
  std::string file_dtype;  // the safetensors name: "F32", "BF16", "U8", ...
};

class FileDataset {
 public:
  // Opens the dataset an index file describes (see the file comment). IoError naming the file.
  explicit FileDataset(const std::filesystem::path& index);
  // Safetensors files holding the same columns (names, dtypes, record shapes), records in order.
  static FileDataset from_shards(const std::vector<std::filesystem::path>& shards);

  std::int64_t size() const;
  const std::vector<ColumnSpec>& columns() const;
  std::int64_t shard_count() const;

  // Record i: every column's row i. ValueError when i is out of range.
  Tree record(std::int64_t i) const;
  // The records at `indices`, stacked along a new leading axis in that order (a batch). ValueError
  // naming an index out of range; IoError when a shard can no longer be read.
  Tree gather(std::span<const std::int64_t> indices) const;

 private:
  struct Impl;
  explicit FileDataset(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

struct FileDatasetWriterOptions {
  std::int64_t records_per_shard = 8192;
};

class FileDatasetWriter {
 public:
  // `index` is the index file to write at close() (its directory must exist); shards go beside it.
  explicit FileDatasetWriter(std::filesystem::path index, FileDatasetWriterOptions options = {});
  ~FileDatasetWriter();
  FileDatasetWriter(const FileDatasetWriter&) = delete;
  FileDatasetWriter& operator=(const FileDatasetWriter&) = delete;

  // Appends records: a dict of arrays whose leading dimension is the number of records (the same
  // for every column). The first write fixes the columns; a later one with other column names,
  // dtypes or record shapes is a ValueError naming the column. ValueError after close().
  void write(const Tree& records);
  // Writes the remaining records as the last shard, then the index. ValueError when nothing was
  // ever written (a dataset needs its columns); IoError when a file cannot be written.
  void close();

  std::int64_t records_written() const { return written_; }
  bool closed() const { return closed_; }

 private:
  void write_shard(std::int64_t records);

  std::filesystem::path index_;
  FileDatasetWriterOptions options_;
  std::vector<ColumnSpec> columns_;
  std::vector<std::vector<std::uint8_t>> pending_;  // per column, the bytes of records not yet in a shard
  std::int64_t pending_records_ = 0, written_ = 0;
  std::vector<std::int64_t> shard_records_;
  bool closed_ = false;
  int uncaught_at_construction_ = 0;
};

}  // namespace linum::datasets
