#include <linum/train/distributed/communicator.hpp>
#include <linum/train/io/serialization.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#if LINUM_HAVE_MPI
#include <linum/train/distributed/mpi.hpp>
#endif

namespace linum::dist {

bool mpi_available() { return LINUM_HAVE_MPI != 0; }

namespace {

[[maybe_unused]] bool mpi_running() {
#if LINUM_HAVE_MPI
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
#else
  return false;
#endif
}

#if LINUM_HAVE_MPI
// MPI errors come back as return codes (the communicators Linum uses are set to MPI_ERRORS_RETURN
// when first used) and become DistErrors naming the call.
void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw DistError(detail::cat("linum::dist: ", call, " failed: ", std::string(text, static_cast<std::size_t>(length))));
}

MPI_Comm comm_of(const Communicator& c) {
  if (!mpi_running())
    throw DistError("linum::dist: MPI is not initialized; create a linum::dist::Session(argc, argv) at the start of main");
  return to_mpi(c);
}
#endif

}  // namespace

Communicator::Communicator() = default;

Communicator Communicator::from_handle(std::uintptr_t handle) {
  Communicator c;
  c.handle_ = handle;
  c.world_ = false;
  return c;
}

int Communicator::rank() const {
#if LINUM_HAVE_MPI
  if (world_ && !mpi_running()) return 0;  // a program that never started MPI is a job of one
  int r = 0;
  check(MPI_Comm_rank(comm_of(*this), &r), "MPI_Comm_rank");
  return r;
#else
  return 0;
#endif
}

int Communicator::size() const {
#if LINUM_HAVE_MPI
  if (world_ && !mpi_running()) return 1;
  int n = 1;
  check(MPI_Comm_size(comm_of(*this), &n), "MPI_Comm_size");
  return n;
#else
  return 1;
#endif
}


namespace {
[[maybe_unused]] int g_thread_level = 0;
}

namespace {

// Whether a launcher (mpirun / mpiexec / srun) started this process: a program run on its own is a
// job of one and needs no MPI at all.
[[maybe_unused]] bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

}  // namespace

Session::Session(int& argc, char**& argv) {
#if LINUM_HAVE_MPI
  if (!mpi_running()) {
    if (!launched_by_mpi()) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) throw DistError("linum::dist::Session: MPI was already finalized in this process; it cannot restart");
    check(MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &g_thread_level), "MPI_Init_thread");
    finalize_ = true;
  } else {
    MPI_Query_thread(&g_thread_level);
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
#else
  (void)argc;
  (void)argv;
#endif
}

Session::Session() {
  int argc = 0;
  char** argv = nullptr;
  Session other(argc, argv);
  finalize_ = std::exchange(other.finalize_, false);
}

Session::~Session() {
#if LINUM_HAVE_MPI
  if (finalize_ && mpi_running()) MPI_Finalize();
#endif
}

bool Session::threads_supported() {
#if LINUM_HAVE_MPI
  return mpi_running() && g_thread_level >= MPI_THREAD_SERIALIZED;
#else
  return false;
#endif
}

int rank(const Communicator& comm) { return comm.rank(); }
int size(const Communicator& comm) { return comm.size(); }

void barrier(const Communicator& comm) {
#if LINUM_HAVE_MPI
  if (comm.size() > 1) check(MPI_Barrier(comm_of(comm)), "MPI_Barrier");
#else
  (void)comm;
#endif
}

Tree broadcast(const Tree& tree, int root, const Communicator& comm) {
  const int n = comm.size();
  if (root < 0 || root >= n)
    throw ValueError(detail::cat("linum::dist::broadcast: root rank ", root, " is not in a job of ", n, " rank(s)"));
  if (n == 1) return tree;
#if LINUM_HAVE_MPI
  // The tree travels as MessagePack (any structure, dtype and shape), its length first.
  MPI_Comm c = comm_of(comm);
  const bool is_root = comm.rank() == root;
  std::vector<std::uint8_t> bytes;
  if (is_root) bytes = serialization::to_msgpack(tree);
  std::uint64_t length = bytes.size();
  check(MPI_Bcast(&length, 1, MPI_UINT64_T, root, c), "MPI_Bcast (tree size)");
  if (!is_root) bytes.resize(length);
  for (std::uint64_t offset = 0; offset < length;) {  // MPI counts are ints: 1 GiB pieces
    const int count = static_cast<int>(std::min<std::uint64_t>(length - offset, 1u << 30));
    check(MPI_Bcast(bytes.data() + offset, count, MPI_BYTE, root, c), "MPI_Bcast (tree)");
    offset += static_cast<std::uint64_t>(count);
  }
  if (is_root) return tree;
  return serialization::from_msgpack(bytes, detail::cat("the tree broadcast by rank ", root));
#else
  return tree;
#endif
}

std::vector<std::uint64_t> allgather(std::uint64_t value, const Communicator& comm) {
  const int n = comm.size();
  std::vector<std::uint64_t> all(static_cast<std::size_t>(n), value);
#if LINUM_HAVE_MPI
  if (n > 1) check(MPI_Allgather(&value, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm_of(comm)), "MPI_Allgather");
#endif
  return all;
}

std::uint64_t checksum(const Tree& tree) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  };
  for (const auto& [path, a] : flatten(tree)) {
    mix(path.data(), path.size() + 0);
    const std::string type = a.type_str();
    mix(type.data(), type.size());
    mix(a.raw(), static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype()));
  }
  return h;
}

std::string checksum_hex(const Tree& tree) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(checksum(tree)));
  return text;
}

void check_replicated(const Tree& tree, const std::string& what, const Communicator& comm) {
  if (comm.size() == 1) return;
  const auto sums = allgather(checksum(tree), comm);
  std::vector<int> differ;
  for (std::size_t r = 1; r < sums.size(); ++r)
    if (sums[r] != sums[0]) differ.push_back(static_cast<int>(r));
  if (differ.empty()) return;
  std::ostringstream ranks;
  for (std::size_t i = 0; i < differ.size(); ++i) ranks << (i ? ", " : "") << differ[i];
  throw DistError(detail::cat("linum::dist: ", what, " differ between ranks: rank(s) ", ranks.str(),
                              " hold other bytes than rank 0; start every rank from dist::broadcast(...) of rank 0's "
                              "tree, and give every rank the same global batch and key"));
}

namespace {

// The sum over ranks, leaf by leaf, in messages of at most bucket_bytes.
Tree allreduce(const Tree& tree, const Communicator& comm, std::int64_t bucket_bytes, bool mean) {
  const int n = comm.size();
  const auto items = flatten(tree);
  for (const auto& [path, a] : items)
    if (a.dtype() != DType::f32)
      throw ShapeError(detail::cat("linum::dist::allreduce: leaf '", path, "' is ", a.type_str(),
                                   "; only float32 leaves can be summed over ranks (cast with astype first)"));
  if (n == 1) return tree;
#if LINUM_HAVE_MPI
  // Every rank must pass the same structure and shapes, else the messages would not line up.
  std::ostringstream layout;
  for (const auto& [path, a] : items) layout << path << ':' << a.type_str() << ';';
  const std::string layout_text = layout.str();
  std::uint64_t layout_hash = 1469598103934665603ull;
  for (unsigned char ch : layout_text) layout_hash = (layout_hash ^ ch) * 1099511628211ull;
  const auto hashes = allgather(layout_hash, comm);
  for (std::size_t r = 0; r < hashes.size(); ++r)
    if (hashes[r] != hashes[0])
      throw DistError(detail::cat("linum::dist::allreduce: rank ", r, " passed a tree of another structure or shapes than rank 0 (",
                                  "this rank has ", items.size(), " leaves); every rank must reduce the same tree"));
  MPI_Comm c = comm_of(comm);
  const std::int64_t bucket_floats = std::max<std::int64_t>(1, bucket_bytes / 4);
  std::vector<Array> out(items.size());
  std::vector<float> bucket;
  std::size_t first = 0;
  const float scale = mean ? 1.0f / static_cast<float>(n) : 1.0f;
  while (first < items.size()) {
    // Leaves [first, last) fill one message (a leaf larger than a bucket goes alone, in pieces).
    std::size_t last = first;
    std::int64_t floats = 0;
    while (last < items.size() && (last == first || floats + items[last].second.numel() <= bucket_floats))
      floats += items[last++].second.numel();
    bucket.resize(static_cast<std::size_t>(floats));
    std::int64_t at = 0;
    for (std::size_t i = first; i < last; ++i) {
      std::memcpy(bucket.data() + at, items[i].second.data(), static_cast<std::size_t>(items[i].second.numel()) * 4);
      at += items[i].second.numel();
    }
    for (std::int64_t offset = 0; offset < floats;) {
      const int count = static_cast<int>(std::min<std::int64_t>(floats - offset, 1 << 28));
      check(MPI_Allreduce(MPI_IN_PLACE, bucket.data() + offset, count, MPI_FLOAT, MPI_SUM, c), "MPI_Allreduce");
      offset += count;
    }
    at = 0;
    for (std::size_t i = first; i < last; ++i) {
      Array a = Array::empty(items[i].second.shape());
      float* dst = a.mutable_data();
      for (std::int64_t e = 0; e < a.numel(); ++e) dst[e] = bucket[static_cast<std::size_t>(at + e)] * scale;
      at += a.numel();
      out[i] = std::move(a);
    }
    first = last;
  }
  return with_leaves(tree, out);
#else
  (void)bucket_bytes;
  (void)mean;
  return tree;
#endif
}

}  // namespace

Tree allreduce_sum(const Tree& tree, const Communicator& comm, std::int64_t bucket_bytes) {
  return allreduce(tree, comm, bucket_bytes, false);
}
Tree allreduce_mean(const Tree& tree, const Communicator& comm, std::int64_t bucket_bytes) {
  return allreduce(tree, comm, bucket_bytes, true);
}

void abort_job(const std::string& message, int exit_code, const Communicator& comm) {
  int r = 0, n = 1;
  try {
    r = comm.rank();
    n = comm.size();
  } catch (...) {
  }
  std::fprintf(stderr, "linum::dist: rank %d of %d: %s\n", r, n, message.c_str());
  std::fflush(stderr);
#if LINUM_HAVE_MPI
  if (mpi_running()) MPI_Abort(to_mpi(comm), exit_code);
#endif
  std::exit(exit_code);
}

int run_or_abort(const std::function<int()>& body, const Communicator& comm) {
  std::string message;
  try {
    return body();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  if (comm.size() == 1) {
    std::fprintf(stderr, "%s\n", message.c_str());
    return 1;
  }
  abort_job(message + " (aborting the job)", 1, comm);
}

}  // namespace linum::dist
