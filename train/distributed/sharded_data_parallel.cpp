#include <linum/train/distributed/sharded_data_parallel.hpp>
#include <linum/train/distributed/data_parallel_internal.hpp>
#include <linum/core/autodiff/custom_vjp.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/saved_hooks.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/modules/scope.hpp>
#include <linum/train/io/serialization.hpp>
#include <linum/train/square_sums.hpp>

#include <nlohmann/json.hpp>

#include <any>
#include <deque>
#include <functional>
#include <cstring>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <limits>
#include <span>
#include <sstream>

#if LINUM_HAVE_MPI
#include <linum/train/distributed/mpi.hpp>
#endif

namespace linum::dist {

using namespace internal;

namespace {

std::int64_t tree_bytes(const Tree& t) {
  std::int64_t n = 0;
  for (const Array& a : leaves(t)) n += static_cast<std::int64_t>(a.nbytes());
  return n;
}

int checked_count(std::int64_t n, const char* what) {
  if (n > std::numeric_limits<int>::max())
    throw DistError(detail::cat("linum::dist::ShardedDataParallel: ", what, " of ", n,
                                " elements exceeds MPI's 2^31-element message limit; use more ranks or a smaller model per job"));
  return static_cast<int>(n);
}

// Copies the rows [begin, end) of `axis` of a row-major array of shape `shape` (flat `src`) to
// `dst`, contiguous.
template <class T>
void copy_slice(const T* src, const Shape& shape, int axis, std::int64_t begin, std::int64_t end, T* dst) {
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= shape[i];
  for (int i = axis + 1; i < shape.rank(); ++i) inner *= shape[i];
  const std::int64_t d = shape[axis], run = (end - begin) * inner;
  if (run == 0) return;
  for (std::int64_t o = 0; o < outer; ++o) std::memcpy(dst + o * run, src + (o * d + begin) * inner, static_cast<std::size_t>(run) * sizeof(T));
}

// Norms of sliced leaves: every rank's exact sums merged (optim::SquareSum).
class RankReductions final : public optim::ShardReductions {
 public:
  explicit RankReductions(Communicator comm) : comm_(comm) {}
  void merge_across_shards([[maybe_unused]] std::vector<optim::SquareSum>& sums) const override {  // unused without MPI
    const int ranks = comm_.size();
    if (ranks == 1) return;
#if LINUM_HAVE_MPI
    const auto counts = allgather(static_cast<std::uint64_t>(sums.size()), comm_);
    for (int r = 1; r < ranks; ++r)
      if (counts[static_cast<std::size_t>(r)] != counts[0])
        throw DistError(detail::cat("linum::dist::ShardedDataParallel: rank ", r, " reduces ", counts[static_cast<std::size_t>(r)],
                                    " norms where rank 0 reduces ", counts[0], "; every rank must run the same optimizer"));
    if (sums.empty()) return;
    constexpr int W = optim::SquareSum::kWords;
    const std::size_t n = sums.size();
    std::vector<std::uint64_t> mine(n * W), all(n * W * static_cast<std::size_t>(ranks));
    for (std::size_t i = 0; i < n; ++i) sums[i].to_words(mine.data() + i * W);
    check_mpi(MPI_Allgather(mine.data(), checked_count(static_cast<std::int64_t>(n * W), "a norm exchange"), MPI_UINT64_T,
                            all.data(), static_cast<int>(n * W), MPI_UINT64_T, to_mpi(comm_)),
              "MPI_Allgather");
    for (std::size_t i = 0; i < n; ++i) {
      optim::SquareSum merged;
      for (int r = 0; r < ranks; ++r) merged.merge(optim::SquareSum::from_words(all.data() + (static_cast<std::size_t>(r) * n + i) * W));
      sums[i] = merged;
    }
#endif
  }
  bool all_across_shards(bool value) const override {
    if (comm_.size() == 1) return value;
    int v = value ? 1 : 0;
#if LINUM_HAVE_MPI
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_LAND, to_mpi(comm_)), "MPI_Allreduce");
#endif
    return v != 0;
  }

 private:
  Communicator comm_;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         (s.size() == suffix.size() || s[s.size() - suffix.size() - 1] == '/');
}

}  // namespace

struct ShardedDataParallel::Impl {
  ShardedDataParallelOptions options;
  optim::GradientTransformation optimizer;
  Communicator comm;
  int me = 0;
  ShardLayout layout;       // over the ranks (stage >= 1) or one rank (stage 0)
  Tree params, local, state;
  std::vector<int> state_owner;  // per optimizer-state leaf: the parameter it mirrors, or -1 (held whole)
  DataParallel data;
  RankReductions reductions;
  std::string broken;  // why the state was lost (an optimizer step that threw), or empty
  void require_intact(const char* call) const {
    if (!broken.empty())
      throw ValueError(detail::cat("linum::dist::ShardedDataParallel::", call, ": ", broken,
                                   "; restore() a checkpoint or build a new trainer"));
  }
  std::int64_t gradient_bytes = 0, activation_bytes = 0;

  Impl(optim::GradientTransformation opt, ShardedDataParallelOptions o)
      : options(std::move(o)), optimizer(std::move(opt)), comm(options.data.comm), me(comm.rank()),
        data(options.data), reductions(comm) {}

  struct SlicedStep;
  // Stages 2 and 3's forward and backward passes, micro-batches round-robin, each parameter's
  // gradient sent to its slices' owners as backward completes it: this rank's gradient slices (and
  // the step's loss, aux, stats).
  std::pair<ShardedStepResult, Tree> sliced_gradients(const LossWithAux& loss, const Tree& batch, rng::Key key);
  // Any stage's forward and backward passes and gradient exchange: this rank's gradient slices
  // (whole leaves at stage 0), the loss, aux and stats; no update.
  std::pair<ShardedStepResult, Tree> gradients(const LossWithAux& loss, const Tree& batch, rng::Key key);
  std::vector<std::size_t> gather_order;    // stage 3: the parameters one micro-batch gathers, in order

  int shards() const { return layout.ranks(); }
  int my_shard() const { return shards() == 1 ? 0 : me; }

  // Which optimizer-state leaves are slices of a parameter (adam's mu and nu) and which are held
  // whole (counts, adafactor's [1] placeholders): a leaf mirrors parameter i when its path ends
  // with i's and it follows i's shape -- also when that shape grows (a second init on slices one
  // index longer along the cut axis), which placeholders do not.
  void map_state(const Tree& grown_state, const Tree& grown) {
    state_owner.clear();
    const auto items = flatten(state);
    const auto grown_items = flatten(grown_state);
    const std::vector<Array> mine = leaves(local), longer = leaves(grown);
    if (grown_items.size() != items.size())
      throw ValueError(detail::cat("linum::dist::ShardedDataParallel: ", optimizer.name(),
                                   "'s state has another structure for other parameter shapes; sharding needs one that "
                                   "follows the parameters' structure"));
    for (std::size_t k = 0; k < items.size(); ++k) {
      const auto& [path, a] = items[k];
      // The longest parameter path the state path ends with (with "b" and "enc/b", "mu/enc/b" is enc/b's).
      int owner = -1;
      std::size_t matched = 0;
      for (std::size_t i = 0; i < layout.leaves().size(); ++i) {
        const std::string& p = layout.leaves()[i].path;
        if (p.size() > matched && ends_with(path, p) && a.shape() == mine[i].shape() &&
            grown_items[k].second.shape() == longer[i].shape()) {
          owner = static_cast<int>(i);
          matched = p.size();
        }
      }
      state_owner.push_back(owner);
    }
  }

  // Every rank's slices, gathered into the whole parameters.
  Tree gather(const Tree& slices, StepStats* stats, double* seconds) {
    if (shards() == 1) return layout.assemble({slices});
    const int ranks = comm.size();
    const auto& ls = layout.leaves();
    auto bytes_of = [&](int r) {
      std::int64_t n = 0;
      for (const auto& l : ls) n += l.shard_numel(r, ranks) * static_cast<std::int64_t>(dtype_size(l.dtype));
      return n;
    };
    std::vector<int> counts(static_cast<std::size_t>(ranks)), displs(static_cast<std::size_t>(ranks));
    std::int64_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      counts[static_cast<std::size_t>(r)] = checked_count(bytes_of(r), "a parameter gather");
      displs[static_cast<std::size_t>(r)] = checked_count(at, "a parameter gather");
      at += bytes_of(r);
    }
    std::vector<unsigned char> send(static_cast<std::size_t>(bytes_of(me))), all(static_cast<std::size_t>(at));
    std::size_t offset = 0;
    const std::vector<Array> mine = leaves(slices);
    if (mine.size() != ls.size())
      throw DistError(detail::cat("linum::dist::ShardedDataParallel: ", mine.size(), " slices for ", ls.size(), " parameters"));
    for (std::size_t i = 0; i < ls.size(); ++i) {
      const Array& a = mine[i];
      if (!(a.shape() == ls[i].shard_shape(me, ranks)) || a.dtype() != ls[i].dtype)
        throw DistError(detail::cat("linum::dist::ShardedDataParallel: the slice of '", ls[i].path, "' is ", a.type_str(),
                                    ", the layout says ", dtype_name(ls[i].dtype), ls[i].shard_shape(me, ranks).str(),
                                    " (did the optimizer change a parameter's shape or dtype?)"));
      if (a.nbytes() > 0) std::memcpy(send.data() + offset, a.raw(), a.nbytes());
      offset += a.nbytes();
    }
    const auto start = Clock::now();
#if LINUM_HAVE_MPI
    check_mpi(MPI_Allgatherv(send.data(), static_cast<int>(send.size()), MPI_BYTE, all.data(), counts.data(), displs.data(),
                             MPI_BYTE, to_mpi(comm)),
              "MPI_Allgatherv");
#endif
    if (seconds) *seconds = seconds_since(start);
    if (stats) {
      stats->messages += 1;
      stats->bytes_sent += static_cast<std::int64_t>(send.size());
      stats->wire_bytes += at * (ranks - 1) / ranks;
    }
    std::vector<Array> whole;
    for (std::size_t i = 0; i < ls.size(); ++i) {
      std::vector<Array> parts;
      for (int r = 0; r < ranks; ++r) {
        std::size_t o = static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]);
        for (std::size_t j = 0; j < i; ++j) o += static_cast<std::size_t>(ls[j].shard_numel(r, ranks)) * dtype_size(ls[j].dtype);
        Array part = Array::empty(ls[i].shard_shape(r, ranks), ls[i].dtype);
        if (part.nbytes() > 0) std::memcpy(part.mutable_raw(), all.data() + o, part.nbytes());
        parts.push_back(std::move(part));
      }
      whole.push_back(layout.join(i, parts));
    }
    return with_leaves(layout.structure(), whole);
  }
};

// ---- stages 2 and 3: gradients sent per parameter as backward completes it; at stage 3 the parameters
// are sliced between steps and gathered when a module reads them ---------------------------------------

namespace {

constexpr const char* kGatherOp = "linum::dist::gather_param";

// The fixed pairwise tree over micro-batches (DataParallel's), evaluated left to right as the
// pieces arrive in order: at most one partial sum per level is alive.
class TreeFold {
 public:
  explicit TreeFold(int pieces) : pieces_(pieces) {}
  int next() const { return next_; }
  void push(int piece, Array value) {
    if (piece != next_)
      throw DistError(detail::cat("linum::dist::ShardedDataParallel: micro-batch ", piece, " arrived where ", next_,
                                  " was due (internal error)"));
    ++next_;
    stack_.push_back({piece, piece + 1, std::move(value)});
    while (stack_.size() >= 2) {
      Node& a = stack_[stack_.size() - 2];
      const Node& b = stack_.back();
      if (!splits_at(a.lo, b.hi, a.hi)) break;
      Array sum = Array::empty(a.value.shape());
      add(a.value.data(), b.value.data(), sum.mutable_data(), static_cast<std::size_t>(sum.numel()));
      a.hi = b.hi;
      a.value = std::move(sum);
      stack_.pop_back();
    }
  }
  const Array& result() const {
    if (stack_.size() != 1 || stack_[0].lo != 0 || stack_[0].hi != pieces_)
      throw DistError("linum::dist::ShardedDataParallel: a gradient missed micro-batches (internal error)");
    return stack_[0].value;
  }
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const Node& s : stack_) n += static_cast<std::int64_t>(s.value.nbytes());
    return n;
  }

 private:
  struct Node {
    int lo, hi;
    Array value;
  };
  // Whether [lo, hi) is a node of the tree over [0, pieces) whose children meet at `mid`.
  bool splits_at(int lo, int hi, int mid) const {
    int a = 0, b = pieces_;
    for (;;) {
      const int c = a + (b - a) / 2;
      if (a == lo && b == hi) return c == mid;
      if (b - a <= 1) return false;
      if (hi <= c) b = c;
      else if (lo >= c) a = c;
      else return false;
    }
  }
  int pieces_, next_ = 0;
  std::vector<Node> stack_;
};

struct Regather {
  std::size_t index;
};

}  // namespace

// One stage-2 or stage-3 step's state: which round runs, the folds of this rank's gradient
// slices, and the hook that gathers a parameter when a module reads it (stage 3). With overlap, communication is started
// and finished at different points of this thread (MPI's nonblocking collectives, started in the
// same order on every rank): the gather of the parameter that the recorded order says comes next
// starts when one is requested, and a gradient exchange is finished at later hook calls (at most
// kExchangesInFlight pending, each holding one parameter's gradient). Without overlap each is
// started and finished where it is needed.
struct ShardedDataParallel::Impl::SlicedStep final : linum::detail::ParamReadHook {
  static constexpr std::size_t kExchangesInFlight = 2;
  Impl& s;
  int pieces, round = 0;
  float weight = 0;
  bool fast, overlap;
  std::vector<TreeFold> folds;          // reproducible: per parameter, this rank's slice
  std::vector<Array> sums;              // fast: per parameter, this rank's slice
  std::vector<int> deposited;           // the round each parameter's gradient last went out in
  // Parameters read more than once per micro-batch (tied weights): the reads' cotangents are added
  // here, in the order they arrive (as autodiff adds a leaf's), and go out with the last one.
  std::vector<int> forward_reads, arrived;
  std::vector<Array> partial;
  std::unordered_map<const void*, std::size_t> gathered;  // whole arrays' buffers -> parameter
  std::map<std::string, std::size_t, std::less<>> index_of;
  std::vector<Array> slices;            // this rank's parameter slices (unchanged during the step)
  // A collective under way, and what to do with its result once it is complete.
  struct Transfer {
#if LINUM_HAVE_MPI
    MPI_Request request = MPI_REQUEST_NULL;
#endif
    std::vector<int> counts, displs;    // gathers: bytes per rank; exchanges: send counts, displs, receive counts, displs
    // Linum arrays, so that the exact memory accounting (live limits, the remat planner, memory())
    // sees them: gathers: every rank's slice bytes (in float32 storage); exchanges: float32.
    Array bytes, send, recv;
    unsigned char* byte_data() { return static_cast<unsigned char*>(bytes.mutable_raw()); }
    std::function<void(Transfer&)> finish;
    bool done = false;
  };
  std::map<std::size_t, std::unique_ptr<Transfer>> ahead;  // prefetched gathers, not yet requested
  std::deque<std::unique_ptr<Transfer>> exchanges;         // gradient exchanges under way, in start order
  std::vector<std::size_t> order_now;   // this round's gather requests, in order
  std::size_t next_in_order = 0;        // where in s.gather_order the last request was, plus one
  double communication_s = 0, exposed_s = 0;
  std::int64_t bytes_sent = 0, wire_bytes = 0, peak_fold_bytes = 0;
  int messages = 0, prefetched = 0;

  bool gathers;                         // stage 3: parameters are gathered; stage 2: held whole
  std::vector<Array> whole_params;      // stage 2
  std::unique_ptr<Transfer> requested;  // the gather a read waits for

  SlicedStep(Impl& impl, int m, bool is_fast, bool overlap_communication, bool gather_params)
      : s(impl), pieces(m), fast(is_fast), overlap(overlap_communication), deposited(impl.layout.leaves().size(), -1),
        forward_reads(impl.layout.leaves().size(), 0), arrived(impl.layout.leaves().size(), 0),
        partial(impl.layout.leaves().size()), gathers(gather_params) {
    if (!gathers) whole_params = linum::leaves(s.params);
    for (std::size_t i = 0; i < s.layout.leaves().size(); ++i) {
      index_of[s.layout.leaves()[i].path] = i;
      folds.emplace_back(m);
    }
    sums.resize(s.layout.leaves().size());
    slices = linum::leaves(s.local);
  }
  ~SlicedStep() {
    // Collectives under way write into this object's buffers and the other ranks wait in them:
    // a step cannot be left with any (sliced_gradients aborts the job first; this is the backstop).
    if (in_flight()) abort_job("linum::dist::ShardedDataParallel: a step ended with collectives under way", 1, s.comm);
  }
  SlicedStep(const SlicedStep&) = delete;
  SlicedStep& operator=(const SlicedStep&) = delete;

  // Whether collectives are under way (a failure now cannot leave them: their buffers are here).
  bool in_flight() const { return requested || !ahead.empty() || !exchanges.empty(); }

  // Waits for a transfer (the time counts as communication the computation waited for).
  void complete(Transfer& t) {
    if (t.done) return;
    const auto start = Clock::now();
#if LINUM_HAVE_MPI
    check_mpi(MPI_Wait(&t.request, MPI_STATUS_IGNORE), "MPI_Wait");
#endif
    const double took = seconds_since(start);
    communication_s += took;
    exposed_s += took;
    t.done = true;
    if (t.finish) t.finish(t);
  }
  // Whether a transfer has completed (moves it along; does not wait).
  bool test(Transfer& t) {
    if (t.done) return true;
#if LINUM_HAVE_MPI
    int flag = 0;
    const auto start = Clock::now();
    check_mpi(MPI_Test(&t.request, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    communication_s += seconds_since(start);
    if (!flag) return false;
#endif
    t.done = true;
    if (t.finish) t.finish(t);
    return true;
  }
  // Finishes the exchanges that have arrived, in order; keeps at most `keep` under way.
  void progress(std::size_t keep) {
    while (!exchanges.empty() && (exchanges.size() > keep || test(*exchanges.front()))) {
      complete(*exchanges.front());
      exchanges.pop_front();
    }
  }

  // Starts gathering parameter i's slices from every rank into a new transfer held by `slot` (a
  // collective call; the slot holds it before MPI does, so a failure sees it under way).
  void start_gather(std::size_t i, std::unique_ptr<Transfer>& slot) {
    const LeafSharding& l = s.layout.leaves()[i];
    const int ranks = s.comm.size();
    const auto elem = static_cast<std::int64_t>(dtype_size(l.dtype));
    slot = std::make_unique<Transfer>();
    Transfer* t = slot.get();
    t->counts.resize(static_cast<std::size_t>(ranks));
    t->displs.resize(static_cast<std::size_t>(ranks));
    std::int64_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      t->counts[static_cast<std::size_t>(r)] = checked_count(l.shard_numel(r, ranks) * elem, "a parameter gather");
      t->displs[static_cast<std::size_t>(r)] = checked_count(at, "a parameter gather");
      at += l.shard_numel(r, ranks) * elem;
    }
    t->bytes = Array::empty(Shape{(at + 3) / 4});
    const Array& mine = slices[i];
    ++messages;
    bytes_sent += static_cast<std::int64_t>(mine.nbytes());
    wire_bytes += at * (ranks - 1) / ranks;
#if LINUM_HAVE_MPI
    const auto start = Clock::now();
    check_mpi(MPI_Iallgatherv(mine.raw(), static_cast<int>(mine.nbytes()), MPI_BYTE, t->byte_data(), t->counts.data(),
                              t->displs.data(), MPI_BYTE, to_mpi(s.comm), &t->request),
              "MPI_Iallgatherv");
    communication_s += seconds_since(start);
#endif
  }

  // Starts the gather the recorded order says follows a request for parameter i (overlap only).
  void prefetch_after(std::size_t i) {
    const std::vector<std::size_t>& order = s.gather_order;
    std::size_t at = order.size();
    for (std::size_t k = next_in_order; k < order.size() && at == order.size(); ++k)
      if (order[k] == i) at = k;
    for (std::size_t k = 0; k < std::min(next_in_order, order.size()) && at == order.size(); ++k)
      if (order[k] == i) at = k;
    if (at == order.size()) return;  // not in the recorded order: no guess
    next_in_order = at + 1;
    if (at + 1 < order.size()) prefetch(order[at + 1]);
  }
  void prefetch(std::size_t j) {
    if (overlap && s.comm.size() > 1 && ahead.count(j) == 0) start_gather(j, ahead[j]);
  }

  // The whole parameter i from every rank's slice (a collective call; not recorded).
  Array gather_whole(std::size_t i) {
    if (!gathers) return whole_params[i];
    const LeafSharding& l = s.layout.leaves()[i];
    const int ranks = s.comm.size();
    std::vector<Array> parts;
    if (ranks == 1) {
      parts.push_back(slices[i]);
    } else {
      order_now.push_back(i);
      if (auto it = ahead.find(i); it != ahead.end()) {
        requested = std::move(it->second);
        ahead.erase(it);
        ++prefetched;
      } else {
        start_gather(i, requested);
      }
      if (overlap) {
        prefetch_after(i);
        progress(kExchangesInFlight);
      }
      complete(*requested);
      for (int r = 0; r < ranks; ++r) {
        Array part = Array::empty(l.shard_shape(r, ranks), l.dtype);
        if (part.nbytes() > 0)
          std::memcpy(part.mutable_raw(), requested->byte_data() + requested->displs[static_cast<std::size_t>(r)], part.nbytes());
        parts.push_back(std::move(part));
      }
      requested.reset();
    }
    Array whole = s.layout.join(i, parts);
    if (whole.nbytes() > 0) gathered[whole.raw()] = i;
    return whole;
  }

  // The cotangent of one read of parameter i (from its gather's backward). A parameter read once
  // per micro-batch sends it at once; one read k times (tied weights) adds the k cotangents as they
  // arrive -- the sum autodiff forms for a leaf used k times, in the same order -- and sends the sum.
  void deposit(std::size_t i, const Array& g) {
    if (forward_reads[i] <= 1) {
      send_gradient(i, g);
      return;
    }
    partial[i] = arrived[i] == 0 ? g : linum::add(partial[i], g);
    if (++arrived[i] < forward_reads[i]) return;
    send_gradient(i, partial[i]);
    partial[i] = Array();
    arrived[i] = 0;
  }
  // Sums of tied parameters some of whose reads got no cotangent (an unused read): they go out now.
  void send_partial_sums() {
    for (std::size_t i = 0; i < partial.size(); ++i)
      if (arrived[i] > 0) {
        send_gradient(i, partial[i]);
        partial[i] = Array();
        arrived[i] = 0;
      }
  }

  // This rank's piece's gradient of parameter i (the whole cotangent): each rank's slice goes to
  // its owner, which adds the round's pieces to its fold in piece order.
  void send_gradient(std::size_t i, const Array& g) {
    if (deposited[i] == round) {
      // Every rank reaches this point together: let the communication under way finish (the
      // other ranks take part in it), then refuse.
      drain();
      throw DistError(detail::cat("linum::dist::ShardedDataParallel: parameter '", s.layout.leaves()[i].path,
                                  "' got a second gradient in one micro-batch from a read the forward pass did not "
                                  "count (a read outside the forward pass?); stage 3 cannot place it: use stage 0 or 1"));
    }
    deposited[i] = round;
    const LeafSharding& l = s.layout.leaves()[i];
    const int ranks = s.comm.size(), me = s.comm.rank();
    const Array g32 = g.dtype() == DType::f32 ? g : astype(g, DType::f32);
    exchanges.push_back(std::make_unique<Transfer>());  // held before MPI holds it
    Transfer* t = exchanges.back().get();
    t->send = Array::empty(Shape{l.held_shape().numel()});
    float* send = t->send.mutable_data();
    t->counts.resize(static_cast<std::size_t>(4 * ranks));  // send counts, displs; receive counts, displs
    int* send_counts = t->counts.data();
    int* send_displs = send_counts + ranks;
    int* recv_counts = send_displs + ranks;
    int* recv_displs = recv_counts + ranks;
    const std::int64_t mine = l.shard_numel(me, ranks);
    std::int64_t at = 0;
    for (int q = 0; q < ranks; ++q) {
      const std::int64_t n = l.shard_numel(q, ranks);
      copy_slice(g32.data(), l.held_shape(), l.axis, l.begin(q, ranks), l.end(q, ranks), send + at);
      for (std::int64_t e = 0; e < n; ++e) send[at + e] *= weight;  // as DataParallel: g * w
      send_counts[q] = checked_count(n, "a gradient exchange");
      send_displs[q] = checked_count(at, "a gradient exchange");
      recv_counts[q] = checked_count(mine, "a gradient exchange");
      recv_displs[q] = checked_count(mine * q, "a gradient exchange");
      at += n;
    }
    ++messages;
    bytes_sent += at * static_cast<std::int64_t>(sizeof(float));
    wire_bytes += (at - mine) * static_cast<std::int64_t>(sizeof(float));
    t->recv = Array::empty(Shape{fast ? mine : mine * ranks});
    const int this_round = round;
    t->finish = [this, i, mine, ranks, this_round](Transfer& done) {
      if (fast) {
        sums[i] = std::move(done.recv);
        done.send = Array();
        return;
      }
      for (int r = 0; r < ranks; ++r) {
        const int piece = this_round * ranks + r;
        if (piece >= pieces) continue;  // a rank with no piece left ran a stand-in
        Array part = Array::empty(Shape{mine});
        if (mine > 0)
          std::memcpy(part.mutable_data(), done.recv.mutable_data() + mine * r,
                      static_cast<std::size_t>(mine) * sizeof(float));
        folds[i].push(piece, std::move(part));
      }
      std::int64_t held = 0;
      for (const TreeFold& f : folds) held += f.bytes();
      peak_fold_bytes = std::max(peak_fold_bytes, held);
      done.send = Array();
      done.recv = Array();
    };
    if (ranks == 1) {
      if (mine > 0) std::memcpy(t->recv.mutable_data(), send, static_cast<std::size_t>(mine) * sizeof(float));
      t->done = true;
      t->finish(*t);
      exchanges.pop_back();
      return;
    }
#if LINUM_HAVE_MPI
    const auto start = Clock::now();
    if (fast)
      check_mpi(MPI_Ireduce_scatter(send, t->recv.mutable_data(), send_counts, MPI_FLOAT, MPI_SUM, to_mpi(s.comm), &t->request),
                "MPI_Ireduce_scatter");
    else
      check_mpi(MPI_Ialltoallv(send, send_counts, send_displs, MPI_FLOAT, t->recv.mutable_data(), recv_counts, recv_displs,
                               MPI_FLOAT, to_mpi(s.comm), &t->request),
                "MPI_Ialltoallv");
    communication_s += seconds_since(start);
#endif
    progress(overlap ? kExchangesInFlight : 0);
  }

  // Finishes everything under way (gathers guessed and not used included).
  void drain() {
    progress(0);
    for (auto& [i, t] : ahead) complete(*t);
    ahead.clear();
  }

  // The round's communication is done (every gradient exchange arrived); guesses not used are
  // dropped; the order of this round's gathers is what the next rounds (and steps) prefetch by.
  void end_round() {
    send_partial_sums();
    drain();
    std::fill(forward_reads.begin(), forward_reads.end(), 0);
    if (!order_now.empty()) s.gather_order = std::move(order_now);
    order_now.clear();
    next_in_order = 0;
  }

  // Parameters no module read this round: zero gradients for the round's pieces (after end_round).
  void fill_unread() {
    const int ranks = s.comm.size();
    for (std::size_t i = 0; i < deposited.size(); ++i) {
      if (deposited[i] == round) continue;
      const std::int64_t mine = s.layout.leaves()[i].shard_numel(s.comm.rank(), ranks);
      if (fast) {
        sums[i] = Array::zeros(Shape{mine});
        continue;
      }
      for (int r = 0; r < ranks; ++r)
        if (round * ranks + r < pieces) folds[i].push(round * ranks + r, Array::zeros(Shape{mine}));
    }
  }

  Array gather_op(std::size_t i, const Array& slice) {
    const Shape shape = slice.shape();
    const DType dtype = slice.dtype();
    auto op = linum::custom_vjp(
        kGatherOp, [this, i](const Array&) { return std::make_pair(gather_whole(i), std::vector<Array>{}); },
        [this, i, shape, dtype](const std::vector<Array>&, const Array& g) {
          deposit(i, g);
          return Array::zeros(shape, dtype);
        });
    return op(slice);
  }

  std::optional<Array> read(const std::string& full_path, const Array& stored, const Shape& wanted) override {
    if (full_path.rfind("params/", 0) != 0) return std::nullopt;
    const auto it = index_of.find(std::string_view(full_path).substr(7));
    if (it == index_of.end()) return std::nullopt;
    const std::size_t i = it->second;
    if (linum::detail::current_phase() == linum::detail::Phase::forward) ++forward_reads[i];
    const LeafSharding& l = s.layout.leaves()[i];
    if (!(wanted == l.shape) || !(stored.shape() == l.shard_shape(s.comm.rank(), s.comm.size())))
      throw DistError(detail::cat("linum::dist::ShardedDataParallel (stage 3): param '", full_path, "' is read as ", wanted,
                                  " from a dict entry of shape ", stored.shape(), "; pass the params tree the loss receives "
                                  "unchanged as the \"params\" collection of apply"));
    return gather_op(i, stored);
  }
};

std::pair<ShardedStepResult, Tree> ShardedDataParallel::Impl::sliced_gradients(const LossWithAux& loss, const Tree& batch,
                                                                               rng::Key key) {
  const bool gathers = options.stage == 3;
  const int ranks = comm.size(), me = comm.rank();
  const bool fast = options.data.reduction == Reduction::fast;
  const std::int64_t rows = batch_rows(batch);
  const int M = fast ? ranks : options.data.micro_batches;
  if (rows < M)
    throw ShapeError(detail::cat("linum::dist::ShardedDataParallel: a global batch of ", rows, " rows cannot be cut into ", M,
                                 fast ? " ranks' shares" : " micro-batches", "; use a larger batch or fewer micro-batches"));
  SlicedStep ctx(*this, M, fast, options.data.overlap, gathers);
  const int rounds = (M + ranks - 1) / ranks;
  ShardedStepResult result;
  result.stats.ranks = ranks;
  TreeFold small(M);
  std::optional<Tree> aux_structure;
  std::vector<float> small_sum;
  // Sync::per_rank: the aux mean over the rows of this rank's pieces.
  std::int64_t own_rows = 0;
  for (int m = me; m < M; m += ranks) own_rows += rows * (m + 1) / M - rows * m / M;
  std::vector<float> own_aux;
  const auto compute_start = Clock::now();
  for (int j = 0; j < rounds; ++j) try {
    ctx.round = j;
    const int m = j * ranks + me;
    const bool real = m < M;
    const int piece = real ? m : M - 1;  // a stand-in keeps the collectives in step; its values are dropped
    const std::int64_t lo = rows * piece / M, hi = rows * (piece + 1) / M;
    ctx.weight = weight_of(lo, hi, rows);
    if (real) {
      ++result.stats.local_pieces;
      result.stats.local_rows += hi - lo;
    }
    const Tree part = rows_of(batch, lo, hi);
    const rng::Key piece_key = rng::fold_in(key, static_cast<std::uint32_t>(piece));
    std::optional<std::tuple<Array, Tree, std::vector<Array>>> out;
    if (!gathers) {
      // Stage 2: the whole parameters go in through one op per leaf, whose backward sends the
      // leaf's gradient (every use summed by autodiff) as soon as it is complete.
      auto [value, aux, grads] = linum::value_and_grad([&](const std::vector<Array>& p) {
        std::vector<Array> params;
        for (std::size_t i = 0; i < p.size(); ++i) params.push_back(ctx.gather_op(i, p[i]));
        return loss(with_leaves(layout.structure(), params), part, piece_key);
      })(linum::leaves(local));
      out.emplace(value, aux, std::move(grads));
    } else {
      linum::detail::ParamReadHookGuard reads(&ctx);
      autodiff::SavedValueHooksGuard regather({
          .pack = [&ctx](const Array& a, const autodiff::SavedValueInfo& info) -> std::any {
            if (info.producer_op != nullptr && std::string_view(info.producer_op) == kGatherOp && a.nbytes() > 0)
              if (auto it = ctx.gathered.find(a.raw()); it != ctx.gathered.end()) return Regather{it->second};
            return a;
          },
          .unpack = [&ctx](const std::any& p) -> Array {
            if (const auto* r = std::any_cast<Regather>(&p)) return ctx.gather_whole(r->index);
            return std::any_cast<const Array&>(p);
          }});
      auto [value, aux, grads] = linum::value_and_grad([&](const std::vector<Array>& p) {
        return loss(with_leaves(layout.structure(), p), part, piece_key);
      })(linum::leaves(local));
      out.emplace(value, aux, std::move(grads));
    }
    ctx.end_round();
    ctx.fill_unread();
    const Array& value = std::get<0>(*out);
    const Tree& aux = std::get<1>(*out);
    require_f32(aux, "aux");
    if (!aux_structure) {
      aux_structure = aux;
      if (ranks > 1) check_same_layout(layout_of(aux), comm, "aux tree");
    } else if (auto diff = structure_difference(*aux_structure, aux)) {
      throw ShapeError(detail::cat("linum::dist::ShardedDataParallel: the loss's aux tree changed between micro-batches: ", *diff));
    }
    std::vector<float> mine;
    append_scaled(mine, astype(value, DType::f32), ctx.weight);
    for (const Array& a : linum::leaves(aux)) append_scaled(mine, a, ctx.weight);
    if (options.data.aux == Sync::per_rank && real) {
      std::vector<float> own;
      for (const Array& a : linum::leaves(aux)) append_scaled(own, a, weight_of(lo, hi, own_rows));
      if (own_aux.empty()) own_aux = std::move(own);
      else add(own_aux.data(), own.data(), own_aux.data(), own.size());
    }
    std::vector<float> all(mine.size() * static_cast<std::size_t>(ranks));
    if (ranks == 1) {
      all = mine;
    } else {
#if LINUM_HAVE_MPI
      const auto start = Clock::now();
      check_mpi(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_FLOAT, all.data(), static_cast<int>(mine.size()),
                              MPI_FLOAT, to_mpi(comm)),
                "MPI_Allgather");
      const double took = seconds_since(start);  // (waiting for the slowest rank shows here)
      ctx.communication_s += took;
      ctx.exposed_s += took;
      ++ctx.messages;
#endif
    }
    for (int r = 0; r < ranks; ++r) {
      const int p = j * ranks + r;
      if (p >= M) continue;
      Array v = Array::empty(Shape{static_cast<std::int64_t>(mine.size())});
      std::memcpy(v.mutable_data(), all.data() + static_cast<std::size_t>(r) * mine.size(), mine.size() * sizeof(float));
      if (fast) {
        if (small_sum.empty()) small_sum.assign(mine.size(), 0.0f);
        for (std::size_t e = 0; e < mine.size(); ++e) small_sum[e] += v.data()[e];  // rank order, as a fast sum may
      } else {
        small.push(p, std::move(v));
      }
    }
    if (j + 1 < rounds && !ctx.s.gather_order.empty()) ctx.prefetch(ctx.s.gather_order.front());  // the next round's first read
  } catch (const std::exception& e) {
    // Gathers and exchanges under way are collectives the other ranks take part in; MPI cannot
    // cancel them, and this step's buffers are about to go.
    if (ctx.in_flight())
      abort_job(detail::cat(e.what(), " (in a stage-", options.stage, " step whose parameters or gradients were being communicated)"),
                1, comm);
    throw;
  } catch (...) {
    if (ctx.in_flight())
      abort_job(detail::cat("an exception that is not a std::exception, in a stage-", options.stage,
                            " step whose parameters or gradients were being communicated"),
                1, comm);
    throw;
  }
  result.stats.compute_s = seconds_since(compute_start) - ctx.communication_s;
  result.stats.communication_s = ctx.communication_s;
  result.stats.exposed_s = ctx.exposed_s;
  result.prefetched_gathers = ctx.prefetched;
  result.stats.bytes_sent = ctx.bytes_sent;
  result.stats.wire_bytes = ctx.wire_bytes;
  result.stats.messages = ctx.messages;
  const float* totals = fast ? small_sum.data() : small.result().data();
  result.loss = Array::full(Shape{}, totals[0]);
  std::size_t offset = 1;
  result.aux = unflat(*aux_structure, totals, offset);
  if (options.data.aux == Sync::per_rank) {
    std::size_t at = 0;
    own_aux.resize(offset - 1, 0.0f);  // (a rank without pieces: zeros)
    result.aux = unflat(*aux_structure, own_aux.data(), at);
  }
  std::vector<Array> slices;
  for (std::size_t i = 0; i < layout.leaves().size(); ++i) {
    const LeafSharding& l = layout.leaves()[i];
    Array g = reshape(fast ? ctx.sums[i] : ctx.folds[i].result(), l.shard_shape(me, ranks).vec());
    slices.push_back(l.dtype == DType::f32 ? g : astype(g, l.dtype));
  }
  std::int64_t slice_bytes = 0;
  for (const Array& g : slices) slice_bytes += static_cast<std::int64_t>(g.nbytes());
  gradient_bytes = std::max(ctx.peak_fold_bytes, slice_bytes);
  return {std::move(result), with_leaves(layout.structure(), slices)};
}

ShardedDataParallel::ShardedDataParallel(const Tree& params, optim::GradientTransformation optimizer,
                                         ShardedDataParallelOptions options)
    : impl_(std::make_unique<Impl>(std::move(optimizer), std::move(options))) {
  Impl& s = *impl_;
  if (s.options.stage < 0 || s.options.stage > 3)
    throw ValueError(detail::cat("linum::dist::ShardedDataParallel: stage must be 0, 1, 2 or 3, got ", s.options.stage));
  if (s.optimizer.takes_per_example_gradients())
    throw ValueError(detail::cat("linum::dist::ShardedDataParallel: ", s.optimizer.name(),
                                 " takes per-example gradients; sharded data parallelism gives the batch's gradient"));
  require_float(params, "parameter");
  check_replicated(params, "the initial parameters (broadcast them from rank 0 with dist::broadcast)", s.comm);
  s.layout = ShardLayout(params, s.options.stage == 0 ? 1 : s.comm.size(), s.options.rules);
  s.params = with_leaves(params, leaves(params));  // the values (axis names stay in the layout)
  s.local = s.layout.shard(s.params, s.my_shard());
  {
    optim::ShardReductionsScope sharded(s.options.stage == 0 ? nullptr : &s.reductions);
    s.state = s.optimizer.init(s.local);
    std::vector<Array> longer;
    for (std::size_t i = 0; i < s.layout.leaves().size(); ++i) {
      const auto& l = s.layout.leaves()[i];
      std::vector<std::int64_t> dims = l.shard_shape(s.my_shard(), s.layout.ranks()).vec();
      dims[static_cast<std::size_t>(l.axis)] += 1;
      longer.push_back(Array::zeros(Shape(dims), l.dtype));
    }
    const Tree grown = with_leaves(s.layout.structure(), longer);
    s.map_state(s.optimizer.init(grown), grown);
  }
  if (s.options.stage == 3) s.params = Tree();  // only the slices stay
  // Every rank must cut every parameter the same way (axis names live in the init dict; a tree that
  // went through dist::broadcast or a file has none) and map the optimizer state the same way.
  if (s.comm.size() > 1) {
    std::string owners;
    for (int o : s.state_owner) owners += std::to_string(o) + ",";
    check_same_layout(detail::cat(s.layout.describe(), "|", owners, "|stage ", s.options.stage, " reduction ",
                                  static_cast<int>(s.options.data.reduction), " micro-batches ", s.options.data.micro_batches,
                                  " overlap ", s.options.data.overlap, " aux ", static_cast<int>(s.options.data.aux)),
                      s.comm,
                      "parameter layout (axis names and rules choose the cut: give every rank the init dict with its "
                      "axis names, or the same ShardingRules), optimizer state or options (stage, reduction, "
                      "micro_batches, overlap, aux: every rank must give the same)");
  }
}

ShardedDataParallel::~ShardedDataParallel() = default;
ShardedDataParallel::ShardedDataParallel(ShardedDataParallel&&) noexcept = default;
ShardedDataParallel& ShardedDataParallel::operator=(ShardedDataParallel&&) noexcept = default;

ShardedStepResult ShardedDataParallel::step(const Loss& loss, const Tree& batch, rng::Key key) {
  return step([&](const Tree& p, const Tree& b, rng::Key k) { return std::make_pair(loss(p, b, k), Tree()); }, batch, key);
}

std::pair<ShardedStepResult, Tree> ShardedDataParallel::Impl::gradients(const LossWithAux& loss, const Tree& batch, rng::Key key) {
  Impl& s = *this;
  ShardedStepResult result;
  Tree grads;  // this rank's slices (whole in stage 0)
  if (s.options.stage >= 2) {
    auto [r, slices] = s.sliced_gradients(loss, batch, key);
    result = std::move(r);
    grads = std::move(slices);
  } else {
    StepResult r = s.data.value_and_grad(loss, s.params, batch, key);
    s.gradient_bytes = tree_bytes(r.grads);
    grads = s.layout.shard(r.grads, s.my_shard());  // (stage 0: the whole leaves, scalars as [1])
    result.loss = r.loss;
    result.aux = r.aux;
    result.stats = r.stats;
  }
  return {std::move(result), std::move(grads)};
}

ShardedStepResult ShardedDataParallel::step(const LossWithAux& loss, const Tree& batch, rng::Key key) {
  Impl& s = *impl_;
  s.require_intact("step");
  memory::reset_peak();
  const std::int64_t live_before = memory::stats().live_bytes;
  auto [result, grads] = s.gradients(loss, batch, key);
  s.activation_bytes = std::max<std::int64_t>(0, memory::stats().peak_bytes - live_before);

  const auto opt_start = Clock::now();
  {
    autodiff::NoGradGuard constants;
    optim::ShardReductionsScope sharded(s.options.stage == 0 ? nullptr : &s.reductions);
    Tree local = std::move(s.local), state = std::move(s.state);
    s.local = Tree();
    s.state = Tree();
    try {
      optim::StepResult next = s.optimizer.step(std::move(local), grads, std::move(state));
      s.local = std::move(next.params);
      s.state = std::move(next.state);
    } catch (const std::exception& e) {
      // The fused step may have updated the buffers in place: the state is gone.
      s.broken = detail::cat("the optimizer step failed (", e.what(), ")");
      throw;
    }
  }
  result.optimizer_s = seconds_since(opt_start);
  if (s.options.stage <= 2) {
    s.params = s.gather(s.local, &result.stats, &result.gather_s);
    result.stats.communication_s += result.gather_s;
  }
  return result;
}

lift::RematPlan ShardedDataParallel::plan_remat(const Loss& loss, const Tree& batch, rng::Key key, std::int64_t budget_bytes,
                                                lift::PlanOptions options) {
  return plan_remat([&](const Tree& p, const Tree& b, rng::Key k) { return std::make_pair(loss(p, b, k), Tree()); }, batch, key,
                    budget_bytes, std::move(options));
}

lift::RematPlan ShardedDataParallel::plan_remat(const LossWithAux& loss, const Tree& batch, rng::Key key, std::int64_t budget_bytes,
                                                lift::PlanOptions options) {
  Impl& s = *impl_;
  s.require_intact("plan_remat");
  if (s.comm.size() > 1) {
    std::string described = detail::cat("profile_steps ", options.profile_steps, " verify ", options.verify, " depths");
    for (int d : options.depths) described += detail::cat(" ", d);
    for (const lift::Policy& p : options.policies) described += " " + p.description();
    check_same_layout(described, s.comm, "remat planner options (every rank must give the same)");
  }
  options.agree = [&s](const std::string& what, std::vector<double>& figures) {
    if (s.comm.size() == 1) return;
    check_same_layout(detail::cat(figures.size(), " figures of ", what), s.comm,
                      "remat plan's profile (every rank must make the same module calls in a step)");
#if LINUM_HAVE_MPI
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, figures.data(), checked_count(static_cast<std::int64_t>(figures.size()), "a plan's profile"),
                            MPI_DOUBLE, MPI_MAX, to_mpi(s.comm)),
              "MPI_Allreduce");
#endif
  };
  // One plan for all: within the smallest budget any rank gives.
  std::int64_t budget = budget_bytes;
#if LINUM_HAVE_MPI
  if (s.comm.size() > 1)
    check_mpi(MPI_Allreduce(&budget_bytes, &budget, 1, MPI_INT64_T, MPI_MIN, to_mpi(s.comm)), "MPI_Allreduce");
#endif
  return lift::plan_remat([&] { (void)s.gradients(loss, batch, key); }, budget, options);
}

Tree ShardedDataParallel::params() const {
  impl_->require_intact("params");
  if (impl_->options.stage == 3) return const_cast<Impl&>(*impl_).gather(impl_->local, nullptr, nullptr);
  return impl_->params;
}
const Tree& ShardedDataParallel::local_params() const { return impl_->local; }
const Tree& ShardedDataParallel::local_optimizer_state() const { return impl_->state; }
const ShardLayout& ShardedDataParallel::layout() const { return impl_->layout; }
int ShardedDataParallel::stage() const { return impl_->options.stage; }

RankBytes ShardedDataParallel::memory() const {
  const Impl& s = *impl_;
  RankBytes b;
  b.params = (s.options.stage == 3 ? 0 : tree_bytes(s.params)) + (s.options.stage == 0 ? 0 : tree_bytes(s.local));
  b.gradients = s.gradient_bytes;
  b.optimizer_state = tree_bytes(s.state);
  b.activations = s.activation_bytes;
  return b;
}

Tree ShardedDataParallel::optimizer_state() const {
  const Impl& s = *impl_;
  s.require_intact("optimizer_state");
  // Each parameter-shaped leaf gathered through the parameters' layout; the rest is the same everywhere.
  const auto items = flatten(s.state);
  std::vector<Array> out;
  for (const auto& [path, a] : items) out.push_back(a);
  // Gather the mirrored leaves one parameter-structure at a time.
  std::vector<std::size_t> pending;
  for (std::size_t k = 0; k < items.size(); ++k)
    if (s.state_owner[k] >= 0) pending.push_back(k);
  Impl& self = const_cast<Impl&>(s);
  while (!pending.empty()) {
    // One round: at most one state leaf per parameter, the others filled with that rank's params.
    std::vector<Array> round = leaves(s.local);
    std::vector<std::size_t> taken(round.size(), static_cast<std::size_t>(-1));
    std::vector<std::size_t> later;
    for (std::size_t k : pending) {
      const auto i = static_cast<std::size_t>(s.state_owner[k]);
      if (taken[i] == static_cast<std::size_t>(-1)) {
        taken[i] = k;
        round[i] = out[k].dtype() == round[i].dtype() ? out[k] : astype(out[k], round[i].dtype());
      } else {
        later.push_back(k);
      }
    }
    const Tree whole = self.gather(with_leaves(s.layout.structure(), round), nullptr, nullptr);
    const std::vector<Array> whole_leaves = leaves(whole);
    for (std::size_t i = 0; i < taken.size(); ++i)
      if (taken[i] != static_cast<std::size_t>(-1))
        out[taken[i]] = whole_leaves[i].dtype() == out[taken[i]].dtype() ? whole_leaves[i] : astype(whole_leaves[i], out[taken[i]].dtype());
    pending = std::move(later);
  }
  return with_leaves(s.state, out);  // (scalars' state whole again: join reshapes [1] to [])
}

// ---- checkpoints -------------------------------------------------------------------------------

namespace {

std::filesystem::path shard_file(const std::filesystem::path& dir, int rank, int ranks) {
  return dir / detail::cat("shard-", rank, "-of-", ranks, ".msgpack");
}

nlohmann::ordered_json layout_json(const ShardLayout& layout, int stage) {
  nlohmann::ordered_json j;
  j["format"] = "linum.sharded/1";
  j["ranks"] = layout.ranks();
  j["stage"] = stage;
  auto& ls = j["leaves"] = nlohmann::ordered_json::array();
  for (const auto& l : layout.leaves())
    ls.push_back({{"path", l.path}, {"dtype", dtype_name(l.dtype)}, {"shape", l.shape.vec()}, {"axis", l.axis}});
  return j;
}

}  // namespace

// Runs `body` on every rank and agrees on the outcome: a rank that failed rethrows its error, the
// others throw a DistError naming it (instead of waiting for it in the next collective call).
template <class F>
void on_every_rank(const Communicator& comm, const char* what, F&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  const auto failed = allgather(error ? 1u : 0u, comm);
  if (error) std::rethrow_exception(error);
  for (std::size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0) throw DistError(detail::cat("linum::dist::ShardedDataParallel::", what, ": rank ", r, " failed (see its error)"));
}

void ShardedDataParallel::save(const std::filesystem::path& dir) const {
  const Impl& s = *impl_;
  s.require_intact("save");
  on_every_rank(s.comm, "save", [&] {
    std::filesystem::create_directories(dir);
    if (s.me < s.shards())
      serialization::save_msgpack(shard_file(dir, s.me, s.shards()), Tree{{"params", s.local}, {"opt_state", s.state}});
    if (s.me == 0) {
      const std::string text = layout_json(s.layout, s.options.stage).dump(1) + "\n";
      serialization::write_file_atomic(dir / "layout.json",
                                       std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
    }
  });
}

void ShardedDataParallel::restore(const std::filesystem::path& dir) {
  Impl& s = *impl_;
  on_every_rank(s.comm, "restore", [&] { restore_local(dir); });
  s.broken.clear();
  if (s.options.stage <= 2) s.params = s.gather(s.local, nullptr, nullptr);
}

void ShardedDataParallel::restore_local(const std::filesystem::path& dir) {
  Impl& s = *impl_;
  const auto text = serialization::read_file(dir / "layout.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end());
  } catch (const std::exception& e) {
    throw IoError(detail::cat("linum::dist::ShardedDataParallel::restore: ", (dir / "layout.json").string(), " is not JSON: ", e.what()));
  }
  if (!j.is_object() || j.value("format", "") != "linum.sharded/1" || !j.contains("ranks") || !j.contains("leaves"))
    throw IoError(detail::cat("linum::dist::ShardedDataParallel::restore: ", (dir / "layout.json").string(),
                              " is not a layout written by ShardedDataParallel::save"));
  const int saved_ranks = j["ranks"].get<int>();
  const auto& saved = j["leaves"];
  const auto& ls = s.layout.leaves();
  if (saved_ranks < 1 || !saved.is_array() || saved.size() != ls.size())
    throw ValueError(detail::cat("linum::dist::ShardedDataParallel::restore: the checkpoint in ", dir.string(), " has ",
                                 saved.is_array() ? saved.size() : 0, " parameters, this model ", ls.size()));
  for (std::size_t i = 0; i < ls.size(); ++i) {
    const auto& e = saved[i];
    if (e.value("path", "") != ls[i].path || e.value("dtype", "") != dtype_name(ls[i].dtype) ||
        e.value("shape", std::vector<std::int64_t>{}) != ls[i].shape.vec() || e.value("axis", -1) != ls[i].axis)
      throw ValueError(detail::cat("linum::dist::ShardedDataParallel::restore: parameter ", i, " of the checkpoint (",
                                   e.dump(), ") differs from this model's '", ls[i].path, "' ", dtype_name(ls[i].dtype),
                                   ls[i].shape.str(), " cut along axis ", ls[i].axis,
                                   "; restore with the model, rules and optimizer that saved it"));
  }
  // Every saved shard (only this rank's when the rank counts agree).
  const int now = s.shards();
  std::vector<Tree> files;
  if (saved_ranks == now) {
    files.push_back(serialization::load_msgpack(shard_file(dir, s.my_shard(), now)));
  } else {
    for (int r = 0; r < saved_ranks; ++r) files.push_back(serialization::load_msgpack(shard_file(dir, r, saved_ranks)));
  }
  for (std::size_t f = 0; f < files.size(); ++f) {
    if (!files[f].contains("params") || !files[f].contains("opt_state"))
      throw IoError(detail::cat("linum::dist::ShardedDataParallel::restore: a shard file in ", dir.string(),
                                " lacks 'params' or 'opt_state'"));
    if (auto diff = structure_difference(s.state, files[f].at("opt_state"), false))
      throw ValueError(detail::cat("linum::dist::ShardedDataParallel::restore: the saved optimizer state differs from this "
                                   "optimizer's: ", *diff, "; restore with the optimizer that saved it"));
  }
  // The old layout: the same axes over the saved number of ranks.
  const ShardLayout old = s.layout.with_ranks(saved_ranks);
  auto reslice = [&](std::size_t i, const std::vector<Array>& parts, DType dtype) {
    const Array whole = old.join(i, parts);
    Array mine = s.layout.slice(i, whole, s.my_shard());
    return mine.dtype() == dtype ? mine : astype(mine, dtype);
  };
  std::vector<Array> local;
  std::vector<Array> state_out;
  if (saved_ranks == now) {
    local = leaves(files[0].at("params"));
    state_out = leaves(files[0].at("opt_state"));
    const std::vector<Array> expect = leaves(s.local);
    for (std::size_t i = 0; i < local.size(); ++i)
      if (!(local[i].shape() == expect[i].shape()) || local[i].dtype() != expect[i].dtype())
        throw ValueError(detail::cat("linum::dist::ShardedDataParallel::restore: the saved slice of '", ls[i].path, "' is ",
                                     local[i].type_str(), ", expected ", expect[i].type_str()));
  } else {
    std::vector<std::vector<Array>> params_of, state_of;
    for (const Tree& f : files) {
      params_of.push_back(leaves(f.at("params")));
      state_of.push_back(leaves(f.at("opt_state")));
    }
    for (std::size_t i = 0; i < ls.size(); ++i) {
      std::vector<Array> parts;
      for (const auto& p : params_of) parts.push_back(p.at(i));
      local.push_back(reslice(i, parts, ls[i].dtype));
    }
    const std::vector<Array> current = leaves(s.state);
    for (std::size_t k = 0; k < current.size(); ++k) {
      if (s.state_owner[k] < 0) {
        state_out.push_back(state_of[0].at(k));
        continue;
      }
      const auto i = static_cast<std::size_t>(s.state_owner[k]);
      std::vector<Array> parts;
      for (const auto& st : state_of) parts.push_back(st.at(k));  // joined in the state's own dtype
      state_out.push_back(reslice(i, parts, current[k].dtype()));
    }
  }
  s.local = with_leaves(s.layout.structure(), local);
  s.state = with_leaves(s.state, state_out);
}

}  // namespace linum::dist
