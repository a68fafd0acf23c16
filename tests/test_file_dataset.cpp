// datasets::FileDataset, FileDatasetWriter, DataSource and the DataLoader's workers: records written
// in shards read back bitwise, the loader's batches the same from files as from memory and for any
// number of workers, and every broken file an error that names it.
#include <doctest/doctest.h>

#include <linum/linum.hpp>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

using namespace linum;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("no exception");
  return {};
}

struct TempDir {
  fs::path path;
  TempDir() : path(fs::temp_directory_path() / ("linum_file_dataset_" + std::to_string(::getpid()))) { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

// n records of three columns in three dtypes, one nested: x f32 [2, 3] (record i's values 6 i ..
// 6 i + 5, scaled), meta/id i32 (i), meta/w bf16 [4].
Tree records(std::int64_t first, std::int64_t n) {
  Array x = Array::empty(Shape{n, 2, 3});
  Array id = Array::empty(Shape{n}, DType::i32);
  std::vector<float> w(static_cast<std::size_t>(n * 4));
  for (std::int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 6; ++k) x.mutable_data()[i * 6 + k] = 0.37f * static_cast<float>(6 * (first + i) + k) - 1.0f;
    id.mutable_data_i32()[i] = static_cast<std::int32_t>(first + i);
    for (int k = 0; k < 4; ++k) w[static_cast<std::size_t>(i * 4 + k)] = 0.5f * static_cast<float>(first + i) + 0.125f * k;
  }
  Array wf = Array::from(Shape{n, 4}, w);
  return Tree{{"x", x}, {"meta", Tree{{"id", id}, {"w", astype(wf, DType::bf16)}}}};
}

bool same_bytes(const Array& a, const Array& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

bool same_tree(const Tree& a, const Tree& b) {
  const auto fa = flatten(a), fb = flatten(b);
  if (fa.size() != fb.size()) return false;
  for (std::size_t i = 0; i < fa.size(); ++i)
    if (fa[i].first != fb[i].first || !same_bytes(fa[i].second, fb[i].second)) return false;
  return true;
}

// Writes records 0..n-1 in batches of the given sizes (cycled).
fs::path write_dataset(const fs::path& dir, std::int64_t n, std::int64_t per_shard, std::vector<std::int64_t> batches) {
  const fs::path index = dir / "set.json";
  datasets::FileDatasetWriter w(index, {.records_per_shard = per_shard});
  for (std::int64_t at = 0, k = 0; at < n; ++k) {
    const std::int64_t b = std::min(batches[static_cast<std::size_t>(k) % batches.size()], n - at);
    w.write(records(at, b));
    at += b;
  }
  w.close();
  return index;
}

std::vector<datasets::Batch> drain(datasets::DataLoader& loader) {
  std::vector<datasets::Batch> out;
  for (const datasets::Batch& b : loader) out.push_back(b);
  return out;
}

}  // namespace

TEST_CASE("records written in shards of any size read back bitwise, one by one and gathered in any order") {
  TempDir dir;
  const std::int64_t n = 53;
  const datasets::ArrayDataset memory(records(0, n));
  for (std::int64_t per_shard : {1, 7, 53, 100}) {
    CAPTURE(per_shard);
    const fs::path index = write_dataset(dir.path, n, per_shard, {5, 10, 3});
    const datasets::FileDataset files(index);
    CHECK(files.size() == n);
    CHECK(files.shard_count() == (n + per_shard - 1) / per_shard);
    REQUIRE(files.columns().size() == 3);
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(same_tree(files.record(i), memory.record(i)));
    // Runs within shards, across shard ends, repeats and reversals.
    const std::vector<std::int64_t> picks = {0, 1, 2, 3, 4, 5, 6, 7, 8, 52, 51, 50, 20, 20, 21, 22, 33, 9, 10, 11, 12, 13, 14};
    CHECK(same_tree(files.gather(picks), memory.gather(picks)));
    CHECK(same_tree(files.gather(std::vector<std::int64_t>{}), memory.gather(std::vector<std::int64_t>{})));
  }
}

TEST_CASE("the index names the shards; each shard is an ordinary safetensors file of the columns") {
  TempDir dir;
  const fs::path index = write_dataset(dir.path, 20, 8, {20});
  CHECK(fs::exists(dir.path / "set-00000.safetensors"));
  CHECK(fs::exists(dir.path / "set-00002.safetensors"));
  CHECK_FALSE(fs::exists(dir.path / "set-00003.safetensors"));
  const safetensors::Contents last = safetensors::load(dir.path / "set-00002.safetensors");
  CHECK(last.tensors.at("x").array().shape() == Shape{4, 2, 3});
  CHECK(same_bytes(last.tensors.at("meta").at("id").array(), Array::from_i32(Shape{4}, {16, 17, 18, 19})));
  // The shards opened directly give the same records.
  const datasets::FileDataset direct = datasets::FileDataset::from_shards(
      {dir.path / "set-00000.safetensors", dir.path / "set-00001.safetensors", dir.path / "set-00002.safetensors"});
  const datasets::FileDataset indexed(index);
  CHECK(direct.size() == 20);
  std::vector<std::int64_t> all(20);
  for (int i = 0; i < 20; ++i) all[static_cast<std::size_t>(i)] = 19 - i;
  CHECK(same_tree(direct.gather(all), indexed.gather(all)));
}

TEST_CASE("from_shards converts file dtypes as safetensors::load does (uint8 images, float16)") {
  TempDir dir;
  // A shard written by hand: a U8 column [3, 2] and an F16 column [3].
  auto le = [](std::uint64_t v, int bytes) {
    std::string s;
    for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return s;
  };
  const std::string header = R"({"pixels":{"dtype":"U8","shape":[3,2],"data_offsets":[0,6]},"h":{"dtype":"F16","shape":[3],"data_offsets":[6,12]}})";
  std::string file = le(header.size(), 8) + header;
  for (int v : {0, 255, 7, 8, 100, 200}) file.push_back(static_cast<char>(v));
  file += le(0x3C00, 2) + le(0xC000, 2) + le(0x3800, 2);  // 1, -2, 0.5
  std::ofstream(dir.path / "hand.safetensors", std::ios::binary) << file;
  const datasets::FileDataset d = datasets::FileDataset::from_shards({dir.path / "hand.safetensors"});
  REQUIRE(d.size() == 3);
  const Tree b = d.gather(std::vector<std::int64_t>{2, 0});
  CHECK(b.at("pixels").array().to_vector_i32() == std::vector<std::int32_t>{100, 200, 0, 255});
  CHECK(b.at("h").array().to_vector() == std::vector<float>{0.5f, 1.0f});
  CHECK(d.columns()[0].file_dtype == "U8");
}

TEST_CASE("a DataLoader over a FileDataset gives the batches it gives over the same records in memory") {
  TempDir dir;
  const std::int64_t n = 45;
  const fs::path index = write_dataset(dir.path, n, 8, {9});
  const datasets::ArrayDataset memory(records(0, n));
  const datasets::FileDataset files(index);
  for (bool drop : {false, true}) {
    const datasets::LoaderOptions opts{.batch_size = 6, .seed = rng::key(3), .drop_remainder = drop, .num_epochs = 2};
    datasets::DataLoader a(memory, opts), b(files, opts);
    const auto from_memory = drain(a), from_files = drain(b);
    REQUIRE(from_memory.size() == from_files.size());
    for (std::size_t k = 0; k < from_memory.size(); ++k) REQUIRE(same_tree(from_memory[k].data, from_files[k].data));
  }
}

TEST_CASE("workers: the same batches in the same order for 1, 2 and 4 workers, prepared on several threads") {
  // A source that records which threads gather and is slow on some batches, so workers finish out of order.
  struct Slow {
    std::shared_ptr<std::mutex> mutex = std::make_shared<std::mutex>();
    std::shared_ptr<std::set<std::thread::id>> threads = std::make_shared<std::set<std::thread::id>>();
    std::int64_t size() const { return 60; }
    Tree gather(std::span<const std::int64_t> idx) const {
      {
        std::lock_guard<std::mutex> lock(*mutex);
        threads->insert(std::this_thread::get_id());
      }
      if (!idx.empty() && idx[0] % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));
      std::vector<std::int32_t> v(idx.begin(), idx.end());
      return Tree{{"i", Array::from_i32(Shape{static_cast<std::int64_t>(v.size())}, v)}};
    }
  };
  std::vector<std::vector<std::int32_t>> reference;
  for (int workers : {1, 2, 4}) {
    CAPTURE(workers);
    Slow source;
    std::atomic<int> transforms_at_once{0}, most_at_once{0};
    datasets::LoaderOptions opts{.batch_size = 4, .seed = rng::key(1), .num_epochs = 3, .prefetch = 6, .workers = workers};
    opts.transform = [&](Tree t, std::int64_t, std::int64_t) {
      const int now = ++transforms_at_once;
      int seen = most_at_once.load();
      while (now > seen && !most_at_once.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      --transforms_at_once;
      return t;
    };
    datasets::DataLoader loader(source, opts);
    std::vector<std::vector<std::int32_t>> got;
    for (const datasets::Batch& b : loader) got.push_back(b.data.at("i").array().to_vector_i32());
    CHECK(got.size() == 45);
    if (reference.empty()) reference = got;
    CHECK(got == reference);
    CHECK(static_cast<int>(source.threads->size()) == workers);
    if (workers > 1) CHECK(most_at_once.load() > 1);
  }
}

TEST_CASE("workers: a failure reaches the next() that would have returned its batch; earlier batches come first") {
  struct FailsAt {
    std::int64_t size() const { return 40; }
    Tree gather(std::span<const std::int64_t> idx) const {
      std::vector<std::int32_t> v(idx.begin(), idx.end());
      return Tree{{"i", Array::from_i32(Shape{static_cast<std::int64_t>(v.size())}, v)}};
    }
  };
  datasets::LoaderOptions opts{.batch_size = 4, .shuffle = false, .prefetch = 4, .workers = 3};
  opts.transform = [](Tree t, std::int64_t, std::int64_t index) {
    if (index == 5) throw ValueError("batch 5 is bad");
    return t;
  };
  datasets::DataLoader loader(FailsAt{}, opts);
  for (int k = 0; k < 5; ++k) CHECK(loader.next()->index == k);
  CHECK(contains(error_of<ValueError>([&] { loader.next(); }), "batch 5 is bad"));
  CHECK(loader.position().index == 5);
}

TEST_CASE("a source whose gather() returns rows of the wrong count is an error naming the column") {
  struct Short {
    std::int64_t size() const { return 10; }
    Tree gather(std::span<const std::int64_t>) const { return Tree{{"bad", Array::zeros(Shape{1, 2})}}; }
  };
  datasets::DataLoader loader(Short{}, {.batch_size = 3, .prefetch = 0});
  CHECK(contains(error_of<ValueError>([&] { loader.next(); }), "column 'bad'"));
  CHECK(contains(error_of<ValueError>([] { datasets::DataLoader(Short{}, {.batch_size = 3, .prefetch = 0, .workers = 2}); }),
                 "prefetch"));
}

TEST_CASE("writer: mismatched columns are errors naming the column; nothing written is an error; a writer left open closes") {
  TempDir dir;
  {
    datasets::FileDatasetWriter w(dir.path / "a.json", {.records_per_shard = 4});
    w.write(records(0, 3));
    Tree wrong = records(3, 2);
    wrong.set("x", Tree(Array::zeros(Shape{2, 3, 2})));
    CHECK(contains(error_of<ValueError>([&] { w.write(wrong); }), "column 'x'"));
    Tree ragged = records(3, 2);
    ragged.set("x", Tree(Array::zeros(Shape{3, 2, 3})));
    CHECK(contains(error_of<ValueError>([&] { w.write(ragged); }), "records"));
    Tree fewer = records(3, 2);
    fewer.at("meta").erase("w");
    CHECK(contains(error_of<ValueError>([&] { w.write(fewer); }), "columns"));
    w.write(records(3, 2));
  }  // closed by the destructor
  CHECK(datasets::FileDataset(dir.path / "a.json").size() == 5);
  CHECK(contains(error_of<ValueError>([&] { datasets::FileDatasetWriter(dir.path / "b.json").close(); }), "nothing was written"));
  CHECK(contains(error_of<ValueError>([&] { datasets::FileDatasetWriter(dir.path / "b.txt"); }), ".json"));
  // An exception unwinding past an open writer leaves no index: the dataset is not complete.
  try {
    datasets::FileDatasetWriter w(dir.path / "c.json", {.records_per_shard = 2});
    w.write(records(0, 5));
    throw std::runtime_error("the program failed half-way");
  } catch (const std::runtime_error&) {
  }
  CHECK(fs::exists(dir.path / "c-00000.safetensors"));
  CHECK_FALSE(fs::exists(dir.path / "c.json"));
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset(dir.path / "c.json"); }), "c.json"));
}

TEST_CASE("broken datasets are IoErrors naming the file: missing shard, shard of other columns or count, truncated after opening") {
  TempDir dir;
  const fs::path index = write_dataset(dir.path, 20, 8, {20});
  const fs::path shard1 = dir.path / "set-00001.safetensors";
  {
    const datasets::FileDataset open(index);
    // Truncated after opening: the reads come up short (an error), never a crash.
    fs::resize_file(dir.path / "set-00002.safetensors", 64);
    const std::string e = error_of<IoError>([&] { open.gather(std::vector<std::int64_t>{18, 19}); });
    CHECK(contains(e, "set-00002.safetensors"));
    CHECK(contains(e, "truncated"));
    CHECK(same_tree(open.record(3), datasets::ArrayDataset(records(0, 20)).record(3)));  // other shards still read
    CHECK(contains(error_of<ValueError>([&] { open.gather(std::vector<std::int64_t>{20}); }), "out of range"));
  }
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset{index}; }), "set-00002.safetensors"));
  // A shard rewritten with another record count, or other columns.
  write_dataset(dir.path, 20, 8, {20});
  safetensors::save(shard1, Tree{{"x", Tree(Array::zeros(Shape{8, 2, 3}))}}, {}, '/');
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset{index}; }), "set-00001.safetensors"));
  write_dataset(dir.path, 20, 8, {20});
  Tree seven = records(8, 7);
  safetensors::save(shard1, seven, {}, '/');
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset{index}; }), "says 8"));
  fs::remove(shard1);
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset{index}; }), "set-00001.safetensors"));
  // Not an index at all.
  std::ofstream(dir.path / "junk.json") << "{\"format\": \"other\"}";
  CHECK(contains(error_of<IoError>([&] { datasets::FileDataset(dir.path / "junk.json"); }), "not a dataset index"));
  CHECK(contains(error_of<ValueError>([&] { datasets::FileDataset::from_shards({}); }), "at least one"));
}
