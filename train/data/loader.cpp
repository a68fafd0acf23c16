#include <linum/train/data/loader.hpp>

#include <linum/core/autodiff/graph.hpp>
#include <linum/train/distributed/communicator.hpp>
#include <linum/core/error.hpp>
#include <linum/rng/random.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace linum::datasets {
namespace {

using linum::detail::cat;

// Rows [i n / P, (i + 1) n / P) of n: P pieces whose sizes differ by at most one.
std::int64_t shard_start(std::int64_t n, int i, int p) { return n * i / p; }

}  // namespace

ShardOptions ShardOptions::by_process() { return {dist::rank(), dist::size()}; }

// The background threads: `workers` of them claim the batches in order from `from` (sequence
// number 0, 1, ...), keeping at most `depth` claimed and not yet taken, and prepare them in
// parallel; take() hands them out in sequence order. A failure is kept in place of the batch it was
// preparing, and no batch after it is claimed.
struct DataLoader::Prefetcher {
  struct Item {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::int64_t, Item> done;  // prepared, by sequence number
  std::int64_t claimed = 0;           // the next sequence number to claim
  std::int64_t taken = 0;             // the next sequence number take() returns
  bool stop = false, failed = false;
  std::vector<std::thread> threads;

  Prefetcher(const DataLoader& loader, LoaderPosition from, std::int64_t depth, int workers) {
    try {
      for (int w = 0; w < workers; ++w) start(loader, from, depth);
    } catch (...) {  // a thread could not start: stop those that did
      shut_down();
      throw;
    }
  }
  void start(const DataLoader& loader, LoaderPosition from, std::int64_t depth) {
    threads.emplace_back([this, &loader, from, depth] {
      autodiff::NoGradGuard no_grad;
      for (;;) {
        std::int64_t seq = 0;
        {
          std::unique_lock<std::mutex> lock(mutex);
          changed.wait(lock, [&] { return stop || failed || claimed - taken < depth; });
          if (stop || failed || loader.finished(loader.advance(from, claimed))) return;
          seq = claimed++;
        }
        Item item;
        try {
          item.batch = loader.make_batch(loader.advance(from, seq));
        } catch (...) {
          item.error = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> lock(mutex);
          failed = failed || item.error != nullptr;
          done.emplace(seq, std::move(item));
        }
        changed.notify_all();
      }
    });
  }
  ~Prefetcher() { shut_down(); }
  void shut_down() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    changed.notify_all();
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
  Item take() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return done.count(taken) != 0; });
    auto it = done.find(taken);
    Item item = std::move(it->second);
    done.erase(it);
    ++taken;
    lock.unlock();
    changed.notify_all();
    return item;
  }
};

// The shuffled orders of the last two epochs asked for (workers may prepare the end of one epoch
// and the start of the next at once), each drawn once.
struct DataLoader::Orders {
  std::mutex mutex;
  std::deque<std::pair<std::int64_t, std::shared_ptr<const std::vector<std::int32_t>>>> recent;

  std::shared_ptr<const std::vector<std::int32_t>> of(std::int64_t epoch, rng::Key seed, std::int64_t n) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [e, order] : recent)
      if (e == epoch) return order;
    const Array order = rng::permutation(rng::fold_in(seed, static_cast<std::uint32_t>(epoch)), n);
    recent.emplace_back(epoch, std::make_shared<const std::vector<std::int32_t>>(order.to_vector_i32()));
    if (recent.size() > 2) recent.pop_front();
    return recent.back().second;
  }
};

DataLoader::DataLoader(DataSource dataset, LoaderOptions options)
    : dataset_(std::move(dataset)), options_(std::move(options)), orders_(std::make_unique<Orders>()) {
  const std::int64_t n = dataset_.size(), b = options_.batch_size;
  if (b < 1) throw ValueError(cat("DataLoader: batch_size must be at least 1, got ", b));
  if (options_.shard.shard_count < 1 || options_.shard.shard_index < 0 ||
      options_.shard.shard_index >= options_.shard.shard_count)
    throw ValueError(cat("DataLoader: shard ", options_.shard.shard_index, " of ", options_.shard.shard_count,
                         " is not a shard; need 0 <= shard_index < shard_count"));
  if (options_.num_epochs < 0) throw ValueError(cat("DataLoader: num_epochs must be 0 (forever) or more, got ", options_.num_epochs));
  if (options_.prefetch < 0) throw ValueError(cat("DataLoader: prefetch must be 0 or more, got ", options_.prefetch));
  if (options_.workers < 1 || (options_.prefetch == 0 && options_.workers > 1))
    throw ValueError(cat("DataLoader: workers must be at least 1 (and 1 with prefetch = 0, which prepares batches in next()), got ",
                         options_.workers, " with prefetch ", options_.prefetch,
                         options_.workers > 1 ? "; give prefetch >= workers" : ""));
  batches_per_epoch_ = options_.drop_remainder ? n / b : (n + b - 1) / b;
  if (batches_per_epoch_ == 0)
    throw ValueError(cat("DataLoader: the dataset's ", n, " records make no batch of ", b,
                         options_.drop_remainder ? " (drop_remainder drops the only, partial one); use a smaller batch_size or drop_remainder = false"
                                                 : "; the dataset is empty"));
}

DataLoader::~DataLoader() { stop_prefetching(); }

void DataLoader::stop_prefetching() { prefetcher_.reset(); }

bool DataLoader::finished(LoaderPosition at) const { return options_.num_epochs != 0 && at.epoch >= options_.num_epochs; }

LoaderPosition DataLoader::after(LoaderPosition at) const { return advance(at, 1); }

LoaderPosition DataLoader::advance(LoaderPosition at, std::int64_t steps) const {
  const std::int64_t flat = at.index + steps;
  return {at.epoch + flat / batches_per_epoch_, flat % batches_per_epoch_};
}

Batch DataLoader::make_batch(LoaderPosition at) const {
  const std::int64_t n = dataset_.size(), b = options_.batch_size;
  const std::int64_t begin = at.index * b, rows = std::min(b, n - begin);
  const int shard = options_.shard.shard_index, shards = options_.shard.shard_count;
  const std::int64_t first = begin + shard_start(rows, shard, shards), last = begin + shard_start(rows, shard + 1, shards);
  std::vector<std::int64_t> indices;
  indices.reserve(static_cast<std::size_t>(last - first));
  if (options_.shuffle) {
    const auto order = orders_->of(at.epoch, options_.seed, n);
    for (std::int64_t k = first; k < last; ++k) indices.push_back((*order)[static_cast<std::size_t>(k)]);
  } else {
    for (std::int64_t k = first; k < last; ++k) indices.push_back(k);
  }
  Batch out{dataset_.gather(indices), at.epoch, at.index, rows, first - begin, at.index + 1 == batches_per_epoch_};
  if (out.data.is_leaf())
    throw ValueError("DataLoader: the dataset's gather() returned a single array; return a dict of columns");
  for (const auto& [name, a] : flatten(out.data))
    if (a.shape().rank() == 0 || a.shape()[0] != static_cast<std::int64_t>(indices.size()))
      throw ValueError(cat("DataLoader: the dataset's gather() of ", indices.size(), " records returned column '", name,
                           "' of shape ", a.shape(), "; every column needs a leading axis of one row per record"));
  if (options_.transform) out.data = options_.transform(std::move(out.data), at.epoch, at.index);
  return out;
}

std::optional<Batch> DataLoader::next() {
  if (finished(position_)) return std::nullopt;
  if (options_.prefetch == 0) {
    autodiff::NoGradGuard no_grad;
    Batch batch = make_batch(position_);
    position_ = after(position_);
    return batch;
  }
  if (!prefetcher_) prefetcher_ = std::make_unique<Prefetcher>(*this, position_, options_.prefetch, options_.workers);
  Prefetcher::Item item = prefetcher_->take();
  if (item.error) {
    stop_prefetching();  // the next call prepares this batch again
    std::rethrow_exception(item.error);
  }
  position_ = after(position_);
  return std::move(item.batch);
}

void DataLoader::seek(LoaderPosition position) {
  if (position.epoch < 0 || position.index < 0 || position.index >= batches_per_epoch_ ||
      (options_.num_epochs != 0 && position.epoch > options_.num_epochs) ||
      (options_.num_epochs != 0 && position.epoch == options_.num_epochs && position.index != 0))
    throw ValueError(cat("DataLoader::seek: batch ", position.index, " of epoch ", position.epoch, " is not a position of this loader (",
                         batches_per_epoch_, " batches per epoch, ", options_.num_epochs, " epochs)"));
  stop_prefetching();
  position_ = position;
}

Tree DataLoader::state_tree() const {
  auto i32 = [](std::int64_t v, const char* what) {
    if (v < INT32_MIN || v > INT32_MAX) throw ValueError(cat("DataLoader::state_tree: ", what, " ", v, " does not fit int32"));
    return Array::full_i32(Shape{}, static_cast<std::int32_t>(v));
  };
  return Tree{{"epoch", i32(position_.epoch, "epoch")},
              {"index", i32(position_.index, "batch index")},
              {"dataset_size", i32(dataset_.size(), "dataset size")},
              {"batch_size", i32(options_.batch_size, "batch size")},
              {"shuffle", i32(options_.shuffle, "shuffle")},
              {"drop_remainder", i32(options_.drop_remainder, "drop_remainder")},
              {"seed", Array::from_i32(Shape{2}, {static_cast<std::int32_t>(options_.seed.hi), static_cast<std::int32_t>(options_.seed.lo)})}};
}

void DataLoader::restore(const Tree& state) {
  auto field = [&](const char* name) -> const Array& {
    if (!state.is_dict() || !state.contains(name) || !state.at(name).is_leaf() || state.at(name).array().dtype() != DType::i32)
      throw ValueError(cat("DataLoader::restore: the state has no int32 field '", name, "'; pass what state_tree() returned"));
    return state.at(name).array();
  };
  auto check = [&](const char* name, std::int64_t expected) {
    const Array& a = field(name);
    if (a.numel() != 1 || a.data_i32()[0] != expected)
      throw ValueError(cat("DataLoader::restore: the state was saved with ", name, " ", a.numel() == 1 ? a.data_i32()[0] : -1,
                           " but this loader has ", expected, "; restore it into a loader over the same data and options"));
  };
  check("dataset_size", dataset_.size());
  check("batch_size", options_.batch_size);
  check("shuffle", options_.shuffle);
  check("drop_remainder", options_.drop_remainder);
  const Array& seed = field("seed");
  if (seed.numel() != 2 || static_cast<std::uint32_t>(seed.data_i32()[0]) != options_.seed.hi ||
      static_cast<std::uint32_t>(seed.data_i32()[1]) != options_.seed.lo)
    throw ValueError(cat("DataLoader::restore: the state was saved with another shuffle seed than this loader's ", options_.seed,
                         "; restore it into a loader with the same seed"));
  const Array& epoch = field("epoch");
  const Array& index = field("index");
  if (epoch.numel() != 1 || index.numel() != 1) throw ValueError("DataLoader::restore: 'epoch' and 'index' must be scalars");
  seek({epoch.data_i32()[0], index.data_i32()[0]});
}

}  // namespace linum::datasets
