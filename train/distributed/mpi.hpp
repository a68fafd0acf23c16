// Linum's communicators and MPI's, for applications that use MPI themselves (include this header
// only where <mpi.h> is available: Linum built with -Dmpi=enabled or auto with Open MPI found).
//
//   MPI_Comm half;
//   MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
//   dist::DataParallel dp({.comm = dist::from_mpi(half)});
#pragma once

#include <linum/train/distributed/communicator.hpp>

#include <mpi.h>

#include <cstdint>
#include <cstring>

namespace linum::dist {

// Linum's handle of an MPI communicator (which stays the caller's to free, after Linum's last use).
inline Communicator from_mpi(MPI_Comm comm) {
  static_assert(sizeof(MPI_Comm) <= sizeof(std::uintptr_t), "MPI_Comm must fit in a pointer-sized handle");
  std::uintptr_t handle = 0;
  std::memcpy(&handle, &comm, sizeof(MPI_Comm));
  if (handle == 0) throw DistError("linum::dist::from_mpi: the communicator is null");
  return Communicator::from_handle(handle);
}

// The MPI communicator of a Linum handle (MPI_COMM_WORLD for the default one).
inline MPI_Comm to_mpi(const Communicator& comm) {
  if (comm.handle() == 0) return MPI_COMM_WORLD;
  MPI_Comm c;
  const std::uintptr_t handle = comm.handle();
  std::memcpy(&c, &handle, sizeof(MPI_Comm));
  return c;
}

}  // namespace linum::dist
