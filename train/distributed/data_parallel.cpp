#include <linum/train/distributed/data_parallel.hpp>
#include <linum/train/distributed/data_parallel_internal.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/core/threading.hpp>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#if LINUM_HAVE_MPI
#include <linum/train/distributed/mpi.hpp>
#endif

namespace linum::dist {
namespace internal {

void check_mpi([[maybe_unused]] int code, [[maybe_unused]] const char* call) {
#if LINUM_HAVE_MPI
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw DistError(detail::cat("linum::dist: ", call, " failed: ", std::string(text, static_cast<std::size_t>(length))));
#endif
}

// The batch size: the leading dimension every leaf of the batch shares.
std::int64_t batch_rows(const Tree& batch) {
  const auto items = flatten(batch);
  if (items.empty()) throw ValueError("linum::dist::DataParallel: the batch tree has no arrays; pass the global batch, e.g. Tree{{\"x\", x}, {\"y\", y}}");
  std::int64_t rows = -1;
  for (const auto& [path, a] : items) {
    if (a.rank() == 0)
      throw ShapeError(detail::cat("linum::dist::DataParallel: batch leaf '", path, "' is a scalar ", a.type_str(),
                                   "; every leaf needs the batch as its first dimension"));
    if (rows < 0) rows = a.dim(0);
    else if (a.dim(0) != rows)
      throw ShapeError(detail::cat("linum::dist::DataParallel: batch leaves disagree on the batch size: '", items[0].first, "' is ",
                                   items[0].second.type_str(), " but '", path, "' is ", a.type_str()));
  }
  return rows;
}

Tree rows_of(const Tree& batch, std::int64_t lo, std::int64_t hi) {
  return tree_map([&](const Array& a) { return slice_axis(a, 0, lo, hi); }, batch);
}

void require_float(const Tree& tree, const char* what) {
  for (const auto& [path, a] : flatten(tree))
    if (!is_floating(a.dtype()))
      throw ShapeError(detail::cat("linum::dist::DataParallel: ", what, " leaf '", path, "' is ", a.type_str(),
                                   "; only float parameters are differentiated and summed (pass integer state in the "
                                   "batch or the aux tree's structure, not among the parameters)"));
}

void require_f32(const Tree& tree, const char* what) {
  for (const auto& [path, a] : flatten(tree))
    if (a.dtype() != DType::f32)
      throw ShapeError(detail::cat("linum::dist::DataParallel: ", what, " leaf '", path, "' is ", a.type_str(),
                                   "; data parallelism sums float32 values (keep parameters in float32, as Flax's "
                                   "param_dtype does, and return float32 aux values)"));
}

// One flat vector: [loss, gradient leaves..., aux leaves...], each scaled by `weight`.
void append_scaled(std::vector<float>& out, const Array& a, float weight) {
  const float* p = a.data();
  const std::size_t at = out.size();
  out.resize(at + static_cast<std::size_t>(a.numel()));
  float* dst = out.data() + at;
  const std::int64_t n = a.numel();
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (n > (1 << 16))
  for (std::int64_t i = 0; i < n; ++i) dst[i] = p[i] * weight;
}

// out[i] = a[i] + b[i], elementwise (so the bits do not depend on the thread count).
void add(const float* a, const float* b, float* out, std::size_t n) {
  const auto count = static_cast<std::int64_t>(n);
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (count > (1 << 16))
  for (std::int64_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
}

namespace {
void add_into(std::vector<float>& a, const std::vector<float>& b) { add(a.data(), b.data(), a.data(), a.size()); }
std::uint64_t hash_of(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

// Leaves of `structure` read from flat[offset...] in order, each in its leaf's dtype (sums are
// float32; a bf16 parameter's gradient is rounded once, after the sum).
Tree unflat(const Tree& structure, const float* flat, std::size_t& offset) {
  std::vector<Array> out;
  for (const Array& leaf : leaves(structure)) {
    Array a = Array::empty(leaf.shape());
    std::memcpy(a.mutable_data(), flat + offset, static_cast<std::size_t>(a.numel()) * sizeof(float));
    offset += static_cast<std::size_t>(a.numel());
    out.push_back(leaf.dtype() == DType::f32 ? std::move(a) : astype(a, leaf.dtype()));
  }
  return with_leaves(structure, out);
}

// The weight of rows [lo, hi) in a batch of `rows`: its share of the batch's mean.
float weight_of(std::int64_t lo, std::int64_t hi, std::int64_t rows) {
  return static_cast<float>(static_cast<double>(hi - lo) / static_cast<double>(rows));
}

// The canonical subtrees of [lo, hi) that cover [a, b), left to right.
void cover(int lo, int hi, int a, int b, std::vector<std::pair<int, int>>& out) {
  if (b <= lo || hi <= a) return;
  if (a <= lo && hi <= b) {
    out.emplace_back(lo, hi);
    return;
  }
  const int mid = lo + (hi - lo) / 2;
  cover(lo, mid, a, b, out);
  cover(mid, hi, a, b, out);
}

std::pair<int, int> pieces_of_rank(int r, int ranks, int pieces) {
  return {static_cast<int>(static_cast<std::int64_t>(r) * pieces / ranks),
          static_cast<int>(static_cast<std::int64_t>(r + 1) * pieces / ranks)};
}

std::string layout_of(const Tree& tree) {
  std::ostringstream s;
  for (const auto& [path, a] : flatten(tree)) s << path << ':' << a.type_str() << ';';
  return s.str();
}

// Every rank must have the same aux structure (the messages are laid out by it).
void check_same_layout(const std::string& layout, const Communicator& comm, const char* what) {
  if (comm.size() == 1) return;
  const auto hashes = allgather(hash_of(layout), comm);
  for (std::size_t r = 1; r < hashes.size(); ++r)
    if (hashes[r] != hashes[0])
      throw DistError(detail::cat("linum::dist: rank ", r, "'s ", what, " has another structure or shapes than rank 0's",
                                  " (this rank's: ", layout.substr(0, 300), "); every rank must run the same model and loss"));
}

}  // namespace internal

using namespace internal;

// ---- the communication thread ---------------------------------------------------------------------

namespace internal {

CommThread::CommThread() {
  worker_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
      lock.unlock();
      const auto start = Clock::now();
      try {
        job();
      } catch (...) {
        std::lock_guard<std::mutex> g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      const double took = seconds_since(start);
      lock.lock();
      busy_s_ += took;
      --running_;
      if (jobs_.empty() && running_ == 0) idle_.notify_all();
    }
  });
}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

void CommThread::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  wake_.notify_one();
}

double CommThread::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  ++waiting_;
  idle_.wait(lock, [&] { return jobs_.empty() && running_ == 0; });
  --waiting_;
  const double busy = busy_s_;
  busy_s_ = 0;
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  return busy;
}

#if LINUM_HAVE_MPI
void wait_request(void* mpi_request, const CommThread* thread, const char* call) {
  auto* request = static_cast<MPI_Request*>(mpi_request);
  for (int done = 0;;) {
    if (thread == nullptr || thread->caller_waiting()) {
      check_mpi(MPI_Wait(request, MPI_STATUS_IGNORE), call);
      return;
    }
    check_mpi(MPI_Test(request, &done, MPI_STATUS_IGNORE), call);
    if (done) return;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}
#endif

}  // namespace internal

// Fast mode's buckets go out from a communication thread during the backward pass.
struct DataParallel::Overlap : CommThread {};

DataParallel::DataParallel(DataParallelOptions options) : options_(std::move(options)) {
  if (options_.micro_batches < 1)
    throw ValueError(detail::cat("linum::dist::DataParallel: micro_batches must be at least 1, got ", options_.micro_batches));
  if (options_.bucket_bytes < 4)
    throw ValueError(detail::cat("linum::dist::DataParallel: bucket_bytes must hold one float, got ", options_.bucket_bytes));
  if (options_.reduction == Reduction::reproducible && options_.micro_batches < options_.comm.size())
    throw ValueError(detail::cat("linum::dist::DataParallel: ", options_.micro_batches, " micro-batches cannot be shared by ",
                                 options_.comm.size(), " ranks; use at least as many micro-batches as ranks (--micro-batches)"));
  if (options_.reduction == Reduction::fast && options_.overlap && options_.comm.size() > 1 && Session::threads_supported())
    overlap_ = std::make_unique<Overlap>();
}

DataParallel::~DataParallel() = default;

std::pair<std::int64_t, std::int64_t> DataParallel::local_rows(std::int64_t batch_size) const {
  const int r = options_.comm.rank(), n = options_.comm.size();
  if (options_.reduction == Reduction::fast) return {batch_size * r / n, batch_size * (r + 1) / n};
  const auto [a, b] = pieces_of_rank(r, n, options_.micro_batches);
  return {batch_size * a / options_.micro_batches, batch_size * b / options_.micro_batches};
}

StepResult DataParallel::value_and_grad(const Loss& loss, const Tree& params, const Tree& batch, rng::Key key) {
  return value_and_grad(
      [&](const Tree& p, const Tree& b, rng::Key k) { return std::make_pair(loss(p, b, k), Tree()); }, params, batch, key);
}

StepResult DataParallel::value_and_grad(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key) {
  require_float(params, "parameter");  // float32 or bf16; gradients are summed in float32
  const std::int64_t rows = batch_rows(batch);
  if (options_.reduction == Reduction::reproducible) {
    if (rows < options_.micro_batches)
      throw ShapeError(detail::cat("linum::dist::DataParallel: a global batch of ", rows, " rows cannot be cut into ",
                                   options_.micro_batches, " micro-batches; use a larger batch or fewer micro-batches"));
    return reproducible(loss, params, batch, key, rows);
  }
  if (rows < options_.comm.size())
    throw ShapeError(detail::cat("linum::dist::DataParallel: a global batch of ", rows, " rows cannot be shared by ",
                                 options_.comm.size(), " ranks"));
  return fast(loss, params, batch, key, rows);
}

// ---- reproducible: a fixed pairwise tree over micro-batches ----------------------------------------

namespace internal {

// What a rank computes in reproducible mode before any exchange: the sums over its canonical
// subtrees of micro-batches, each a flat [loss, gradient leaves..., aux leaves...] vector weighted
// by the pieces' shares of the global batch.
struct LocalSubtrees {
  std::vector<std::pair<int, int>> nodes;
  std::vector<std::vector<float>> sums;
  Tree aux_structure;
  std::vector<float> local_aux;  // Sync::per_rank: the aux mean over this rank's rows
  std::int64_t row_lo = 0, row_hi = 0;
};
LocalSubtrees local_subtrees(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key, std::int64_t rows,
                             int micro_batches, const Communicator& comm, Sync aux_sync) {
  const int ranks = comm.size(), me = comm.rank(), M = micro_batches;
  const std::pair<int, int> my_pieces = pieces_of_rank(me, ranks, M);
  LocalSubtrees out;
  out.row_lo = rows * my_pieces.first / M;
  out.row_hi = rows * my_pieces.second / M;
  std::optional<Tree> aux_structure;
  const std::int64_t row_lo = out.row_lo, row_hi = out.row_hi;
  const std::vector<Array> param_leaves = leaves(params);

  // Piece m's flat [loss, grads, aux], weighted by its share of the global batch.
  auto piece = [&](int m) {
    const std::int64_t lo = rows * m / M, hi = rows * (m + 1) / M;
    const Tree part = rows_of(batch, lo, hi);
    const rng::Key piece_key = rng::fold_in(key, static_cast<std::uint32_t>(m));
    auto [value, aux, grads] = linum::value_and_grad([&](const std::vector<Array>& p) {
      return loss(with_leaves(params, p), part, piece_key);
    })(param_leaves);
    require_f32(aux, "aux");
    if (!aux_structure) {
      aux_structure = aux;
    } else if (auto diff = structure_difference(*aux_structure, aux)) {
      throw ShapeError(detail::cat("linum::dist::DataParallel: the loss's aux tree changed between micro-batches: ", *diff,
                                   "; return the same float32 arrays for every piece of the batch"));
    }
    const float w = weight_of(lo, hi, rows);
    std::vector<float> flat;
    append_scaled(flat, astype(value, DType::f32), w);
    for (const Array& g : grads) append_scaled(flat, g.dtype() == DType::f32 ? g : astype(g, DType::f32), w);
    for (const Array& a : leaves(aux)) append_scaled(flat, a, w);
    if (aux_sync == Sync::per_rank) {
      std::vector<float> mine;
      for (const Array& a : leaves(aux)) append_scaled(mine, a, weight_of(lo, hi, row_hi - row_lo));
      if (out.local_aux.empty()) out.local_aux = std::move(mine);
      else add_into(out.local_aux, mine);
    }
    return flat;
  };
  // The sum over [lo, hi) (all local), in the fixed tree.
  std::function<std::vector<float>(int, int)> local_sum = [&](int lo, int hi) {
    if (hi - lo == 1) return piece(lo);
    const int mid = lo + (hi - lo) / 2;
    std::vector<float> left = local_sum(lo, mid);
    const std::vector<float> right = local_sum(mid, hi);
    add_into(left, right);
    return left;
  };
  cover(0, M, my_pieces.first, my_pieces.second, out.nodes);
  for (const auto& [lo, hi] : out.nodes) out.sums.push_back(local_sum(lo, hi));
  out.aux_structure = *aux_structure;
  return out;
}

const float* complete_tree(int micro_batches, const std::map<std::pair<int, int>, const float*>& have, std::size_t length,
                           std::deque<std::vector<float>>& scratch) {
  std::function<const float*(int, int)> sum = [&](int lo, int hi) -> const float* {
    if (auto it = have.find({lo, hi}); it != have.end()) return it->second;
    if (hi - lo <= 1)
      throw DistError(detail::cat("linum::dist: micro-batch ", lo, " was computed by no rank (internal error)"));
    const int mid = lo + (hi - lo) / 2;
    const float* left = sum(lo, mid);
    const float* right = sum(mid, hi);
    scratch.emplace_back(length);
    add(left, right, scratch.back().data(), length);
    return scratch.back().data();
  };
  return sum(0, micro_batches);
}

}  // namespace internal

StepResult DataParallel::reproducible(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key,
                                      std::int64_t rows) {
  const Communicator& comm = options_.comm;
  const int ranks = comm.size(), M = options_.micro_batches;
  StepResult result;
  result.stats.ranks = ranks;
  const auto compute_start = Clock::now();
  LocalSubtrees local = local_subtrees(loss, params, batch, key, rows, M, comm, options_.aux);
  for (const auto& [lo, hi] : local.nodes) result.stats.local_pieces += hi - lo;
  result.stats.local_rows = local.row_hi - local.row_lo;
  result.stats.compute_s = seconds_since(compute_start);
  [[maybe_unused]] const std::size_t L = local.sums.front().size();  // used with MPI only

  std::vector<float> total;
  std::vector<float> gathered;
  std::deque<std::vector<float>> sums;  // the tree's nodes summed here
  const float* total_values = nullptr;
  if (ranks == 1) {
    total = std::move(local.sums.front());
    total_values = total.data();
  } else {
#if LINUM_HAVE_MPI
    check_same_layout(layout_of(params) + "|" + layout_of(local.aux_structure), comm, "parameters and aux tree");
    // Every rank's subtrees, in rank order, gathered on every rank.
    std::vector<int> counts(static_cast<std::size_t>(ranks)), displs(static_cast<std::size_t>(ranks));
    std::vector<std::pair<std::pair<int, int>, std::size_t>> where;  // subtree -> offset in `gathered`
    std::int64_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::pair<int, int>> theirs;
      const auto [a, b] = pieces_of_rank(r, ranks, M);
      cover(0, M, a, b, theirs);
      const std::int64_t count = static_cast<std::int64_t>(theirs.size() * L);
      if (at + count > std::numeric_limits<int>::max())
        throw DistError("linum::dist::DataParallel: the partial sums exceed MPI's 2^31-element message limit; use fewer micro-batches");
      counts[static_cast<std::size_t>(r)] = static_cast<int>(count);
      displs[static_cast<std::size_t>(r)] = static_cast<int>(at);
      for (std::size_t i = 0; i < theirs.size(); ++i) where.emplace_back(theirs[i], static_cast<std::size_t>(at) + i * L);
      at += count;
    }
    std::vector<float> send;
    if (local.sums.size() == 1) {
      send = std::move(local.sums.front());
    } else {
      send.reserve(local.nodes.size() * L);
      for (const auto& s : local.sums) send.insert(send.end(), s.begin(), s.end());
    }
    local.sums.clear();
    gathered.resize(static_cast<std::size_t>(at));
    const auto comm_start = Clock::now();
    check_mpi(MPI_Allgatherv(send.data(), static_cast<int>(send.size()), MPI_FLOAT, gathered.data(), counts.data(),
                             displs.data(), MPI_FLOAT, to_mpi(comm)),
              "MPI_Allgatherv");
    result.stats.communication_s = result.stats.exposed_s = seconds_since(comm_start);
    result.stats.bytes_sent = static_cast<std::int64_t>(send.size() * sizeof(float));
    // A ring allgather passes on every block but the next rank's own: (P - 1) / P of the total.
    result.stats.wire_bytes = at * static_cast<std::int64_t>(sizeof(float)) * (ranks - 1) / ranks;
    result.stats.messages = 3;  // two layout checks + the gather
    // The rest of the tree, from the gathered subtrees (read in place).
    std::map<std::pair<int, int>, const float*> have;
    for (const auto& [node, offset] : where) have[node] = gathered.data() + offset;
    total_values = complete_tree(M, have, L, sums);
#else
    throw DistError("linum::dist: built without MPI");
#endif
  }
  std::size_t offset = 1;
  result.loss = Array::full(Shape{}, total_values[0]);
  result.grads = unflat(params, total_values, offset);
  if (options_.aux == Sync::average) {
    result.aux = unflat(local.aux_structure, total_values, offset);
  } else {
    std::size_t at = 0;
    result.aux = unflat(local.aux_structure, local.local_aux.data(), at);
  }
  return result;
}

// ---- fast: one pass per rank, bucketed allreduce overlapping the backward pass ----------------------

namespace {

struct Bucket {
  std::vector<std::size_t> params;  // indices into the flattened parameters
  std::vector<std::size_t> offset;  // where each starts in `values`
  std::vector<float> values;
  int pending = 0;
};

}  // namespace

StepResult DataParallel::fast(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key,
                              std::int64_t rows) {
  const Communicator& comm = options_.comm;
  const int ranks = comm.size(), me = comm.rank();
  const std::pair<std::int64_t, std::int64_t> my_rows = local_rows(rows);
  const std::int64_t lo = my_rows.first, hi = my_rows.second;
  const float w = weight_of(lo, hi, rows);
  const Tree part = rows_of(batch, lo, hi);
  const rng::Key rank_key = rng::fold_in(key, static_cast<std::uint32_t>(me));
  StepResult result;
  result.stats.ranks = ranks;
  result.stats.local_pieces = 1;
  result.stats.local_rows = hi - lo;

  if (ranks == 1) {  // a job of one: the shard is the batch
    auto [value, aux, grads] = linum::value_and_grad([&](const std::vector<Array>& p) {
      return loss(with_leaves(params, p), part, rank_key);
    })(leaves(params));
    require_f32(aux, "aux");
    result.stats.compute_s = 0;
    result.loss = astype(value, DType::f32);
    result.grads = with_leaves(params, grads);
    result.aux = aux;
    return result;
  }
  const std::vector<Array> param_leaves = leaves(params);
  const std::size_t n = param_leaves.size();
  // Buckets over the parameters in reverse order (the backward pass finishes the last layers first).
  std::vector<Bucket> buckets;
  std::vector<std::pair<std::size_t, std::size_t>> place(n);  // param -> (bucket, index in bucket)
  const std::int64_t cap = std::max<std::int64_t>(1, options_.bucket_bytes / 4);
  for (std::size_t k = n; k-- > 0;) {
    const std::int64_t size = param_leaves[k].numel();
    if (buckets.empty() || (!buckets.back().params.empty() &&
                            static_cast<std::int64_t>(buckets.back().values.size()) + size > cap))
      buckets.emplace_back();
    Bucket& b = buckets.back();
    place[k] = {buckets.size() - 1, b.params.size()};
    b.params.push_back(k);
    b.offset.push_back(b.values.size());
    b.values.resize(b.values.size() + static_cast<std::size_t>(size));
    ++b.pending;
  }

  const bool communicate = ranks > 1;
  double inline_comm_s = 0;
  const bool polite = overlap_ != nullptr;
  auto reduce_bucket = [&, communicate, polite](Bucket& b) {
#if LINUM_HAVE_MPI
    if (!communicate) return;
    for (std::size_t at = 0; at < b.values.size();) {
      const int count = static_cast<int>(std::min<std::size_t>(b.values.size() - at, 1u << 28));
      if (polite) {
        // On the communication thread: a blocking MPI call would spin on a core the backward pass
        // needs (Open MPI polls), so start the reduction and look in on it between short sleeps.
        MPI_Request request;
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, b.values.data() + at, count, MPI_FLOAT, MPI_SUM, to_mpi(comm), &request),
                  "MPI_Iallreduce");
        wait_request(&request, overlap_.get(), "MPI_Iallreduce");
      } else {
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, b.values.data() + at, count, MPI_FLOAT, MPI_SUM, to_mpi(comm)), "MPI_Allreduce");
      }
      at += static_cast<std::size_t>(count);
    }
#else
    (void)polite;
    (void)b;
    (void)communicate;
#endif
  };
  std::size_t next_bucket = 0;
  std::vector<bool> arrived(n, false);
  auto submit_ready = [&] {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      Bucket* b = &buckets[next_bucket++];
      if (overlap_) overlap_->submit([b, &reduce_bucket] { reduce_bucket(*b); });
    }
  };
  auto deliver = [&](std::size_t k, const Array& g) {
    if (arrived[k]) return;
    arrived[k] = true;
    auto [bi, j] = place[k];
    Bucket& b = buckets[bi];
    const Array g32 = g.dtype() == DType::f32 ? g : astype(g, DType::f32);
    const float* p = g32.data();
    float* dst = b.values.data() + b.offset[j];
    for (std::int64_t e = 0; e < g32.numel(); ++e) dst[e] = p[e] * w;
    --b.pending;
    submit_ready();
  };

  // Told by the backward sweep when a parameter's gradient is final.
  struct Listener final : autodiff::LeafGradientListener {
    std::unordered_map<const autodiff::Node*, std::size_t> index;
    std::function<void(std::size_t, const Array&)> deliver;
    void on_leaf_gradient(const autodiff::Node* leaf, const Array& grad) override {
      if (auto it = index.find(leaf); it != index.end()) deliver(it->second, grad);
    }
  };
  std::optional<Listener> listener;
  if (overlap_) {
    listener.emplace();
    listener->deliver = deliver;
  }
  // Every rank must hold the same parameter layout before buckets go out (a mismatch would make
  // the allreduces disagree, not fail).
  if (communicate) check_same_layout(layout_of(params), comm, "parameters");
  const auto compute_start = Clock::now();
  auto run = [&] {
    return linum::value_and_grad([&](const std::vector<Array>& tracked) {
      if (listener)
        for (std::size_t k = 0; k < tracked.size(); ++k)
          if (tracked[k].node() != nullptr) listener->index[tracked[k].node().get()] = k;
      return loss(with_leaves(params, tracked), part, rank_key);
    })(param_leaves);
  };
  std::optional<decltype(run())> computed;
  try {
    computed.emplace(run());
  } catch (const std::exception& e) {
    // Buckets already handed to MPI are collectives the other ranks take part in; MPI cannot cancel
    // them, and this step's buffers are about to go. The job cannot go on.
    if (overlap_ && next_bucket > 0)
      abort_job(detail::cat(e.what(), " (in a data-parallel step whose gradients were already being sent)"), 1, comm);
    throw;
  }
  auto& [value, aux, grads] = *computed;
  listener.reset();
  require_f32(aux, "aux");
  result.stats.compute_s = seconds_since(compute_start);
  // Gradients the sweep did not announce (parameters the loss does not use: zeros).
  for (std::size_t k = 0; k < n; ++k) deliver(k, grads[k]);

  const auto wait_start = Clock::now();
  if (overlap_) {
    result.stats.communication_s = overlap_->wait();
  } else {
    const auto comm_start = Clock::now();
    for (Bucket& b : buckets) reduce_bucket(b);
    inline_comm_s = seconds_since(comm_start);
    result.stats.communication_s = inline_comm_s;
  }
  // The loss and aux: one small message.
  std::vector<float> small;
  append_scaled(small, astype(value, DType::f32), w);
  if (options_.aux == Sync::average)
    for (const Array& a : leaves(aux)) append_scaled(small, a, w);
#if LINUM_HAVE_MPI
  if (communicate) {
    check_same_layout(layout_of(aux), comm, "aux tree");
    const auto small_start = Clock::now();
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, small.data(), static_cast<int>(small.size()), MPI_FLOAT, MPI_SUM, to_mpi(comm)),
              "MPI_Allreduce");
    result.stats.communication_s += seconds_since(small_start);
  }
#endif
  result.stats.exposed_s = seconds_since(wait_start);
  if (communicate) {
    std::int64_t floats = static_cast<std::int64_t>(small.size());
    for (const Bucket& b : buckets) floats += static_cast<std::int64_t>(b.values.size());
    result.stats.bytes_sent = floats * 4;
    result.stats.wire_bytes = 2 * floats * 4 * (ranks - 1) / ranks;  // a ring allreduce's share per rank
    result.stats.messages = static_cast<int>(buckets.size()) + 3;  // + two layout checks and the loss/aux sum
  }

  result.loss = Array::full(Shape{}, small[0]);
  std::vector<Array> out(n);
  for (std::size_t k = 0; k < n; ++k) {
    const auto [bi, j] = place[k];
    Array a = Array::empty(param_leaves[k].shape());
    std::memcpy(a.mutable_data(), buckets[bi].values.data() + buckets[bi].offset[j],
                static_cast<std::size_t>(a.numel()) * sizeof(float));
    out[k] = param_leaves[k].dtype() == DType::f32 ? std::move(a) : astype(a, param_leaves[k].dtype());
  }
  result.grads = with_leaves(params, out);
  if (options_.aux == Sync::average) {
    std::size_t offset = 1;
    result.aux = unflat(aux, small.data(), offset);
  } else {
    result.aux = aux;
  }
  return result;
}

}  // namespace linum::dist
