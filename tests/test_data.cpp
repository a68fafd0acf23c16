// linum::datasets: ArrayDataset, IDX files, and the DataLoader's order, batching, sharding, prefetching
// and resumption -- the properties a training script relies on.
#include <doctest/doctest.h>

#include <linum/linum.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
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

// Record i: x = [i, 100 + i, 200 + i] (float32), y = i (int32).
datasets::ArrayDataset numbered(std::int64_t n) {
  Array x = Array::empty(Shape{n, 3});
  Array y = Array::empty(Shape{n}, DType::i32);
  for (std::int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 3; ++k) x.mutable_data()[i * 3 + k] = static_cast<float>(100 * k + i);
    y.mutable_data_i32()[i] = static_cast<std::int32_t>(i);
  }
  return datasets::ArrayDataset(Tree{{"x", x}, {"y", y}});
}

std::vector<std::int32_t> ids(const datasets::Batch& b) { return b.data.at("y").array().to_vector_i32(); }

std::vector<datasets::Batch> drain(datasets::DataLoader& loader) {
  std::vector<datasets::Batch> out;
  for (const datasets::Batch& b : loader) out.push_back(b);
  return out;
}

struct TempDir {
  fs::path path;
  TempDir() : path(fs::temp_directory_path() / ("linum_data_" + std::to_string(::getpid()))) { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

// A program's own function named `data` next to `using namespace linum;` (as the README's examples
// write): Linum's data pipeline lives in linum::datasets, so no name of Linum's collides with it.
int data(int x) { return x + 1; }

TEST_CASE("using namespace linum leaves a user's function named data unambiguous") { CHECK(data(41) == 42); }

TEST_CASE("ArrayDataset: records, gathers and slices rows of every column; refuses ragged columns") {
  const datasets::ArrayDataset d = numbered(10);
  CHECK(d.size() == 10);
  const Tree r = d.record(7);
  CHECK(r.at("x").array().shape() == Shape{3});
  CHECK(r.at("x").array().to_vector() == std::vector<float>{7, 107, 207});
  CHECK(r.at("y").array().item() == 7);
  const std::vector<std::int64_t> rows{4, 2, 9};
  const Tree g = d.gather(rows);
  CHECK(g.at("x").array().shape() == Shape{3, 3});
  CHECK(g.at("y").array().to_vector_i32() == std::vector<std::int32_t>{4, 2, 9});
  CHECK(d.slice(3, 6).columns().at("y").array().to_vector_i32() == std::vector<std::int32_t>{3, 4, 5});

  const std::string ragged = error_of<ValueError>([] {
    datasets::ArrayDataset(Tree{{"x", Array::zeros(Shape{5, 2})}, {"y", Array::zeros(Shape{4})}});
  });
  CHECK(contains(ragged, "'y' has 4 records"));
  CHECK(contains(ragged, "'x' has 5"));
  CHECK(contains(error_of<ValueError>([] { datasets::ArrayDataset(Tree{{"x", Array::full(Shape{}, 1.0f)}}); }), "scalar"));
  CHECK(contains(error_of<ValueError>([&] { d.record(10); }), "10 records"));
  CHECK(contains(error_of<ValueError>([&] { d.slice(4, 11); }), "end <= 10"));
}

TEST_CASE("each epoch visits every record once, in permutation(fold_in(seed, epoch)) order") {
  datasets::DataLoader loader(numbered(23), {.batch_size = 5, .seed = rng::key(7), .num_epochs = 3});
  CHECK(loader.batches_per_epoch() == 5);  // 4 full batches and one of 3 rows
  const std::vector<datasets::Batch> batches = drain(loader);
  REQUIRE(batches.size() == 15);
  for (int epoch = 0; epoch < 3; ++epoch) {
    const std::vector<std::int32_t> order = rng::permutation(rng::fold_in(rng::key(7), static_cast<std::uint32_t>(epoch)), 23).to_vector_i32();
    std::vector<std::int32_t> seen;
    for (int b = 0; b < 5; ++b) {
      const datasets::Batch& batch = batches[static_cast<std::size_t>(epoch * 5 + b)];
      CHECK(batch.epoch == epoch);
      CHECK(batch.index == b);
      CHECK(batch.last_in_epoch == (b == 4));
      CHECK(batch.global_rows == (b == 4 ? 3 : 5));
      for (std::int32_t i : ids(batch)) seen.push_back(i);
      // Columns stay aligned: row k of x belongs to record y[k].
      const std::vector<float> x = batch.data.at("x").array().to_vector();
      for (std::size_t k = 0; k < ids(batch).size(); ++k) CHECK(x[3 * k + 2] == static_cast<float>(200 + ids(batch)[k]));
    }
    CHECK(seen == order);
    CHECK(std::set<std::int32_t>(seen.begin(), seen.end()).size() == 23);
  }
  CHECK(ids(batches[0]) != ids(batches[5]));  // a new order each epoch
  CHECK_FALSE(loader.next());
}

TEST_CASE("shuffle = false keeps the dataset's order; drop_remainder drops the partial batch") {
  datasets::DataLoader plain(numbered(7), {.batch_size = 3, .shuffle = false, .drop_remainder = true});
  const std::vector<datasets::Batch> b = drain(plain);
  REQUIRE(b.size() == 2);
  CHECK(ids(b[0]) == std::vector<std::int32_t>{0, 1, 2});
  CHECK(ids(b[1]) == std::vector<std::int32_t>{3, 4, 5});
  CHECK(b[1].last_in_epoch);
  CHECK(contains(error_of<ValueError>([] { datasets::DataLoader(numbered(2), {.batch_size = 3, .drop_remainder = true}); }),
                 "make no batch of 3"));
  CHECK(contains(error_of<ValueError>([] { datasets::DataLoader(numbered(4), {.batch_size = 0}); }), "batch_size must be at least 1"));
  CHECK(contains(error_of<ValueError>([] { datasets::DataLoader(numbered(4), {.batch_size = 2, .shard = {2, 2}}); }),
                 "shard 2 of 2"));
}

TEST_CASE("num_epochs = 0 repeats forever, each epoch reshuffled") {
  datasets::DataLoader loader(numbered(6), {.batch_size = 6, .seed = rng::key(1), .num_epochs = 0});
  std::set<std::vector<std::int32_t>> orders;
  for (int e = 0; e < 6; ++e) {
    const auto b = loader.next();
    REQUIRE(b);
    CHECK(b->epoch == e);
    orders.insert(ids(*b));
  }
  CHECK(orders.size() > 1);
}

TEST_CASE("the shards of a global batch put together are the one-process batch, for 1, 2 and 3 shards") {
  const datasets::ArrayDataset d = numbered(29);
  datasets::DataLoader whole(d, {.batch_size = 8, .seed = rng::key(3), .num_epochs = 2});
  const std::vector<datasets::Batch> reference = drain(whole);
  for (int shards : {1, 2, 3}) {
    std::vector<std::vector<datasets::Batch>> per_shard;
    for (int i = 0; i < shards; ++i) {
      datasets::DataLoader part(d, {.batch_size = 8, .seed = rng::key(3), .num_epochs = 2, .shard = {i, shards}});
      per_shard.push_back(drain(part));
    }
    for (std::size_t b = 0; b < reference.size(); ++b) {
      std::vector<std::int32_t> joined;
      std::vector<float> joined_x;
      for (int i = 0; i < shards; ++i) {
        const datasets::Batch& piece = per_shard[static_cast<std::size_t>(i)][b];
        CHECK(piece.first_row == static_cast<std::int64_t>(joined.size()));
        CHECK(piece.global_rows == reference[b].global_rows);
        for (std::int32_t k : ids(piece)) joined.push_back(k);
        for (float v : piece.data.at("x").array().to_vector()) joined_x.push_back(v);
      }
      CHECK(joined == ids(reference[b]));
      CHECK(joined_x == reference[b].data.at("x").array().to_vector());
    }
  }
}

TEST_CASE("the shard rows are the rows dist::DataParallel's fast mode computes on that rank") {
  // DataParallel::local_rows on one process covers the whole batch; the formula is the loader's.
  datasets::DataLoader part(numbered(10), {.batch_size = 10, .shuffle = false, .shard = {1, 3}});
  const datasets::Batch b = *part.next();
  CHECK(b.first_row == 10 * 1 / 3);
  CHECK(b.data.at("y").array().numel() == 10 * 2 / 3 - 10 * 1 / 3);
}

TEST_CASE("prefetching returns the same batches as preparing them in next(), prepared ahead on another thread") {
  const datasets::ArrayDataset d = numbered(40);
  std::atomic<int> prepared{0};
  std::atomic<bool> other_thread{false};
  const auto caller = std::this_thread::get_id();
  auto transform = [&](Tree batch, std::int64_t, std::int64_t) {
    ++prepared;
    if (std::this_thread::get_id() != caller) other_thread = true;
    return tree_map([](const Array& a) { return a.dtype() == DType::f32 ? a * 2.0f : a; }, batch);
  };
  datasets::DataLoader sync(d, {.batch_size = 4, .seed = rng::key(5), .num_epochs = 2, .prefetch = 0, .transform = transform});
  const std::vector<datasets::Batch> expected = drain(sync);
  CHECK_FALSE(other_thread.load());
  CHECK(expected[0].data.at("x").array().to_vector()[2] == 2.0f * static_cast<float>(200 + ids(expected[0])[0]));

  prepared = 0;
  datasets::DataLoader ahead(d, {.batch_size = 4, .seed = rng::key(5), .num_epochs = 2, .prefetch = 3, .transform = transform});
  const auto first = ahead.next();
  REQUIRE(first);
  // While the caller holds the first batch, the loader's thread prepares the next three, no more.
  for (int i = 0; i < 2000 && prepared.load() < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(prepared.load() == 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(prepared.load() == 4);
  CHECK(other_thread.load());
  std::vector<datasets::Batch> got{*first};
  for (const datasets::Batch& b : ahead) got.push_back(b);
  REQUIRE(got.size() == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(bitwise_equal(got[i].data, expected[i].data));
}

TEST_CASE("a failure while preparing a batch reaches the caller, and the batch can be asked for again") {
  std::atomic<int> failures{1};
  auto transform = [&](Tree batch, std::int64_t, std::int64_t index) {
    if (index == 2 && failures.fetch_sub(1) > 0) throw IoError("augmentation failed on batch 2");
    return batch;
  };
  for (int prefetch : {0, 2}) {
    failures = 1;
    datasets::DataLoader loader(numbered(20), {.batch_size = 4, .prefetch = prefetch, .transform = transform});
    CHECK(loader.next()->index == 0);
    CHECK(loader.next()->index == 1);
    CHECK(contains(error_of<IoError>([&] { loader.next(); }), "batch 2"));
    CHECK(loader.position() == datasets::LoaderPosition{0, 2});
    CHECK(loader.next()->index == 2);
  }
}

TEST_CASE("a loader restored from state_tree() continues exactly where the saved one stood, across epochs and shard counts") {
  const datasets::ArrayDataset d = numbered(30);
  const datasets::LoaderOptions options{.batch_size = 4, .seed = rng::key(11), .num_epochs = 3};
  datasets::DataLoader uninterrupted(d, options);
  const std::vector<datasets::Batch> all = drain(uninterrupted);
  REQUIRE(all.size() == 24);

  for (int stop_after : {5, 8, 13}) {  // mid-epoch, at an epoch's end, mid-epoch in the second epoch
    Tree saved;
    {
      datasets::DataLoader first(d, options);
      for (int i = 0; i < stop_after; ++i) first.next();
      saved = first.state_tree();
    }
    // Saved and read back as a checkpoint would be.
    saved = serialization::from_msgpack(serialization::to_msgpack(saved));
    datasets::DataLoader resumed(d, options);
    resumed.restore(saved);
    std::vector<datasets::Batch> rest = drain(resumed);
    REQUIRE(rest.size() == all.size() - static_cast<std::size_t>(stop_after));
    for (std::size_t i = 0; i < rest.size(); ++i) {
      CHECK(rest[i].epoch == all[i + static_cast<std::size_t>(stop_after)].epoch);
      CHECK(bitwise_equal(rest[i].data, all[i + static_cast<std::size_t>(stop_after)].data));
    }
    // Two processes resume the same position: their shards are the batch.
    datasets::LoaderOptions half = options;
    half.shard = {0, 2};
    datasets::DataLoader shard0(d, half);
    shard0.restore(saved);
    const std::vector<std::int32_t> next_ids = ids(all[static_cast<std::size_t>(stop_after)]);
    CHECK(ids(*shard0.next()) == std::vector<std::int32_t>(next_ids.begin(), next_ids.begin() + 2));
  }

  datasets::DataLoader saved_from(d, options);
  saved_from.next();
  const Tree state = saved_from.state_tree();
  datasets::LoaderOptions other = options;
  other.batch_size = 5;
  datasets::DataLoader wrong_batch(d, other);
  CHECK(contains(error_of<ValueError>([&] { wrong_batch.restore(state); }), "batch_size 4 but this loader has 5"));
  other = options;
  other.seed = rng::key(12);
  datasets::DataLoader wrong_seed(d, other);
  CHECK(contains(error_of<ValueError>([&] { wrong_seed.restore(state); }), "seed"));
  datasets::DataLoader wrong_data(numbered(31), options);
  CHECK(contains(error_of<ValueError>([&] { wrong_data.restore(state); }), "dataset_size 30"));
  CHECK(contains(error_of<ValueError>([&] { wrong_data.restore(Tree{{"epoch", Array::full(Shape{}, 1.0f)}}); }), "int32 field"));
  datasets::DataLoader seeking(d, options);
  CHECK(contains(error_of<ValueError>([&] { seeking.seek({3, 1}); }), "not a position"));
  seeking.seek({3, 0});  // the end
  CHECK_FALSE(seeking.next());
}

TEST_CASE("IDX files: write_idx and read_idx round-trip, plain and gzip; load_mnist gives image and label columns") {
  TempDir tmp;
  const Array cube = Array::from(Shape{2, 2, 3}, {0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254, 255});
  datasets::write_idx(tmp.path / "cube-idx3-ubyte", cube);
  datasets::write_idx(tmp.path / "cube-idx3-ubyte.gz", cube);
  CHECK(fs::file_size(tmp.path / "cube-idx3-ubyte") == 4 + 3 * 4 + 12);
  for (const char* name : {"cube-idx3-ubyte", "cube-idx3-ubyte.gz"}) {
    CHECK(datasets::read_idx(tmp.path / name).bitwise_equal(cube));
    const Array as_int = datasets::read_idx(tmp.path / name, DType::i32);
    CHECK(as_int.dtype() == DType::i32);
    CHECK(as_int.to_vector_i32()[11] == 255);
    CHECK(datasets::read_idx(tmp.path / name, DType::f32, 0.5f).to_vector()[3] == 1.5f);
  }
  CHECK(contains(error_of<ValueError>([&] { datasets::write_idx(tmp.path / "bad", Array::from(Shape{2}, {1.5f, 2})); }),
                 "integers 0..255"));
  CHECK(contains(error_of<ValueError>([&] { datasets::read_idx(tmp.path / "cube-idx3-ubyte", DType::i32, 2.0f); }), "float32 only"));

  const Array images = Array::from(Shape{3, 2, 2}, {0, 255, 51, 102, 1, 2, 3, 4, 5, 6, 7, 8});
  const Array labels = Array::from_i32(Shape{3}, {9, 0, 4});
  datasets::write_mnist(tmp.path, "train", images, labels);
  const datasets::ArrayDataset d = datasets::load_mnist(tmp.path, "train");
  CHECK(d.size() == 3);
  CHECK(d.columns().at("image").array().shape() == Shape{3, 2, 2, 1});
  CHECK(d.columns().at("image").array().to_vector()[1] == 1.0f);
  CHECK(d.columns().at("image").array().to_vector()[2] == 51.0f / 255.0f);
  CHECK(d.columns().at("label").array().to_vector_i32() == std::vector<std::int32_t>{9, 0, 4});
  CHECK(contains(error_of<IoError>([&] { datasets::load_mnist(tmp.path, "t10k"); }), "t10k-images-idx3-ubyte.gz' is missing"));
  datasets::write_idx(tmp.path / "t10k-images-idx3-ubyte.gz", images);
  datasets::write_idx(tmp.path / "t10k-labels-idx1-ubyte.gz", Array::from_i32(Shape{2}, {1, 2}));
  CHECK(contains(error_of<IoError>([&] { datasets::load_mnist(tmp.path, "t10k"); }), "2 labels for 3 images"));
}
