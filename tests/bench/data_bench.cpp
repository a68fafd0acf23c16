// linum-bench data: a dataset larger than what a loader holds, written with FileDatasetWriter and
// read back through a shuffling DataLoader with 1, 2, ... workers.
//
//   linum-bench data [--records N] [--floats F] [--batch B] [--workers 1,2] [--transform-us U] [--dir DIR]
//
// N records of F float32 values and an int32 label (default 131072 x 1024: 512 MiB) are written in
// shards of 8192 records; then, for each worker count, the shards are dropped from the page cache
// (posix_fadvise DONTNEED, so the reads come from the disk as in the first epoch over a dataset
// larger than memory) and one shuffled epoch is read in batches of B, each batch's transform
// spending about U microseconds of arithmetic on it (decoding or augmentation stands in). JSON
// lines: the write (write_s, write_mib_per_s, peak_rss_growth_mib), then per worker count
// records_per_s, epoch_s and peak_rss_growth_mib (the process's peak resident memory above what it
// held before the epoch: a loader holds a few batches, not the dataset).
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "bench_util.hpp"

using namespace linum_bench;

namespace {

void drop_from_page_cache(const std::filesystem::path& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::vector<int> int_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream s(text);
  for (std::string item; std::getline(s, item, ',');) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int bench_data(const Flags& f) {
  const std::int64_t N = f.get("records", 131072), F = f.get("floats", 1024), B = f.get("batch", 256);
  const long transform_us = f.get("transform-us", 2000);
  const std::filesystem::path dir =
      std::filesystem::path(f.text("dir", std::filesystem::temp_directory_path().string())) / ("linum_bench_data_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path index = dir / "bench.json";
  const long rss_before_write = status_kib("VmRSS:");
  reset_peak_rss();
  const auto t_write = Clock::now();
  {
    datasets::FileDatasetWriter writer(index, {.records_per_shard = 8192});
    const std::int64_t chunk = 4096;
    for (std::int64_t at = 0; at < N; at += chunk) {
      const std::int64_t n = std::min(chunk, N - at);
      Array x = Array::empty(Shape{n, F});
      Array y = Array::empty(Shape{n}, DType::i32);
      for (std::int64_t i = 0; i < n; ++i) {
        y.mutable_data_i32()[i] = static_cast<std::int32_t>((at + i) % 10);
        for (std::int64_t k = 0; k < F; ++k) x.mutable_data()[i * F + k] = static_cast<float>((at + i + k) % 251) / 251.0f;
      }
      writer.write(Tree{{"x", x}, {"y", y}});
    }
    writer.close();
  }
  const double write_s = seconds_since(t_write);
  const double mib = static_cast<double>(N) * static_cast<double>(F * 4 + 4) / (1 << 20);
  std::cout << nlohmann::json{{"bench", "data"}, {"phase", "write"}, {"records", N}, {"floats", F}, {"dataset_mib", mib},
                              {"write_s", write_s}, {"write_mib_per_s", mib / write_s},
                              {"peak_rss_growth_mib", static_cast<double>(status_kib("VmHWM:") - rss_before_write) / 1024.0}}
                   .dump()
            << std::endl;

  const datasets::FileDataset dataset(index);
  for (int workers : int_list(f.text("workers", "1,2"))) {
    drop_from_page_cache(dir);
    datasets::LoaderOptions options{.batch_size = B, .seed = rng::key(0), .drop_remainder = true, .num_epochs = 1,
                                    .prefetch = 2 * workers, .workers = workers};
    // The stand-in for decoding or augmenting: a fixed amount of arithmetic per batch.
    options.transform = [transform_us, F](Tree batch, std::int64_t, std::int64_t) {
      const auto until = Clock::now() + std::chrono::microseconds(transform_us);
      volatile float sink = 0.0f;
      const float* x = batch.at("x").array().data();
      while (Clock::now() < until)
        for (std::int64_t k = 0; k < 4096; ++k) sink = sink + x[k % F];
      return batch;
    };
    const long rss_before = status_kib("VmRSS:");
    reset_peak_rss();
    datasets::DataLoader loader(dataset, options);
    const auto t0 = Clock::now();
    std::int64_t records = 0;
    double checksum = 0.0;
    for (const datasets::Batch& b : loader) {
      records += b.data.at("y").array().numel();
      checksum += b.data.at("x").array().data()[0];
    }
    const double epoch_s = seconds_since(t0);
    std::cout << nlohmann::json{{"bench", "data"}, {"phase", "read"}, {"workers", workers}, {"batch", B},
                                {"transform_us", transform_us}, {"records", records}, {"epoch_s", epoch_s},
                                {"records_per_s", static_cast<double>(records) / epoch_s},
                                {"read_mib_per_s", mib * static_cast<double>(records) / static_cast<double>(N) / epoch_s},
                                {"peak_rss_growth_mib", static_cast<double>(status_kib("VmHWM:") - rss_before) / 1024.0},
                                {"checksum", checksum}}
                     .dump()
              << std::endl;
  }
  std::filesystem::remove_all(dir);
  return 0;
}
