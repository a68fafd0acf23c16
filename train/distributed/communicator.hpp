// linum::dist: several processes training one model, over MPI.
//
// A job is N processes started by `mpirun -np N program ...` (on one machine or on the hosts of a
// host file); each is a *rank* 0..N-1 of a communicator. Linum talks to the others only through
// the few collective calls below, so it composes with an application that already uses MPI: pass
// your own communicator (dist::from_mpi in <linum/train/distributed/mpi.hpp>), or let Linum use
// MPI_COMM_WORLD.
//
//   int main(int argc, char** argv) {
//     linum::dist::Session mpi(argc, argv);        // MPI_Init ... MPI_Finalize (if nobody else did)
//     return linum::dist::run_or_abort([&] {       // a rank that throws ends the whole job
//       Tree params = dist::broadcast(init(...));  // every rank starts from rank 0's variables
//       ...
//     });
//   }
//
// Collective calls must be made by every rank of the communicator, in the same order. Without MPI
// (the meson option -Dmpi=disabled, or no libopenmpi-dev), the same calls work for one process:
// size() is 1, broadcast and allreduce return their argument.
#pragma once

#include <linum/core/error.hpp>
#include <linum/core/tree.hpp>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>

namespace linum::dist {

// Communication failed or ranks disagree (different trees, a rank that left the job).
struct DistError : Error {
  using Error::Error;
};

// Whether this Linum was built with MPI (otherwise every communicator has one rank).
bool mpi_available();

// A group of processes that talk together: MPI_COMM_WORLD by default. Cheap to copy; it does not
// own the MPI communicator (whoever created it frees it).
class Communicator {
 public:
  // MPI_COMM_WORLD (one process without MPI).
  Communicator();
  int rank() const;
  int size() const;
  // The MPI_Comm, as stored bits (dist::to_mpi in mpi.hpp turns it back into an MPI_Comm).
  std::uintptr_t handle() const { return handle_; }
  static Communicator from_handle(std::uintptr_t handle);

 private:
  std::uintptr_t handle_ = 0;
  bool world_ = true;
};

// MPI for this process's lifetime: when a launcher (mpirun, mpiexec, srun) started the process,
// initializes MPI (asking for MPI_THREAD_SERIALIZED, so Linum's communication thread may call MPI
// while the main thread waits) unless the application already did, and finalizes it on
// destruction if it initialized it. A program started on its own is a job of one and does not
// touch MPI; without MPI built in, Session does nothing.
class Session {
 public:
  Session(int& argc, char**& argv);
  Session();
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  // Whether MPI gives the thread support overlapped communication needs (SERIALIZED or better).
  static bool threads_supported();

 private:
  bool finalize_ = false;
};

// This process's rank in `comm` (0 without MPI) and the number of ranks (1 without MPI).
int rank(const Communicator& comm = Communicator());
int size(const Communicator& comm = Communicator());

// Waits until every rank of `comm` has called it.
void barrier(const Communicator& comm = Communicator());

// Rank `root`'s tree on every rank (any structure, shapes and dtypes: the others' arguments are
// ignored and may be empty). Used to start every rank from the same variables.
Tree broadcast(const Tree& tree, int root = 0, const Communicator& comm = Communicator());

// The elementwise sum / mean over ranks of a float32 tree with the same structure, shapes and
// dtypes on every rank (checked first: a DistError names the first rank and leaf that differ).
// Leaves are packed into messages of at most `bucket_bytes`. Every rank gets the same bits.
Tree allreduce_sum(const Tree& tree, const Communicator& comm = Communicator(), std::int64_t bucket_bytes = 16 << 20);
Tree allreduce_mean(const Tree& tree, const Communicator& comm = Communicator(), std::int64_t bucket_bytes = 16 << 20);

// Every rank's value, in rank order.
std::vector<std::uint64_t> allgather(std::uint64_t value, const Communicator& comm = Communicator());

// A 64-bit hash (FNV-1a) of the tree's paths, dtypes, shapes and leaf bytes: equal trees have equal
// checksums on every machine; print it to compare runs.
std::uint64_t checksum(const Tree& tree);
// The checksum as 16 hex digits.
std::string checksum_hex(const Tree& tree);

// Throws DistError unless every rank of `comm` holds bitwise the same tree, naming `what`, the
// ranks whose checksum differs from rank 0's and what to do.
void check_replicated(const Tree& tree, const std::string& what, const Communicator& comm = Communicator());

// Ends the whole job: prints "linum::dist: rank R of N: <message>" to stderr and calls MPI_Abort
// (std::exit without MPI). The other ranks are terminated by mpirun instead of waiting forever in
// a collective call.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1, const Communicator& comm = Communicator());

// Runs `body` and returns its exit code; an exception that escapes it aborts the job through
// abort_job, naming this rank and the exception's message. With one rank, the exception's message
// is printed and 1 returned (as an ordinary program would).
int run_or_abort(const std::function<int()>& body, const Communicator& comm = Communicator());

}  // namespace linum::dist
