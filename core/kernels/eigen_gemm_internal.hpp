// Internal (include from .cpp files only: it pulls in Eigen). Matrix products with Linum's own
// threading policy: small products run on the calling thread; large ones are split into row (or
// column) panels, one per OpenMP thread, each an Eigen single-threaded GEMM. Eigen's own
// parallelisation starts threads for products of a few hundred thousand multiply-adds, where waking
// the team costs more than it saves and, on a busy machine, stalls the whole step.
#pragma once

#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels::detail {

// Products with fewer multiply-adds than this run on one thread.
constexpr double kParallelGemmWork = 4.0 * 1024 * 1024;

// C = A * B (or C += A * B when `accumulate`), for Eigen expressions of matching sizes.
template <class Dst, class Lhs, class Rhs>
void gemm_into(Dst&& c, const Lhs& a, const Rhs& b, bool accumulate = false) {
  static std::once_flag eigen_single_threaded;  // Eigen itself stays single-threaded; the panels are the threads
  std::call_once(eigen_single_threaded, [] { Eigen::setNbThreads(1); });
  const Eigen::Index m = c.rows(), n = c.cols();
  const Eigen::Index k = a.cols();
  // Small products in one piece; larger ones in panels (below), whatever the thread count.
  if (static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) < kParallelGemmWork) {
    if (accumulate) c.noalias() += a * b;
    else c.noalias() = a * b;
    return;
  }
  const bool by_rows = m >= n;
  const Eigen::Index extent = by_rows ? m : n;
  // Up to 16 panels, aligned to 16 rows/columns so each fits the GEMM kernel's register tiles. The
  // panels are fixed by the shape alone: Eigen's bits within a panel depend on its width, so panels
  // sized by the thread count would give other bits on another team. team_size() threads take them
  // (fewer when other processes hold cores).
  const Eigen::Index panel = std::max<Eigen::Index>(64, ((extent + 15) / 16 + 15) / 16 * 16);
  const Eigen::Index panels = (extent + panel - 1) / panel;
#pragma omp parallel for schedule(dynamic, 1) num_threads(linum::team_size()) if (!omp_in_parallel() && panels > 1)
  for (Eigen::Index p = 0; p < panels; ++p) {
    linum::detail::enter_compute();
    const Eigen::Index start = p * panel, len = std::min(panel, extent - start);
    if (by_rows) {
      auto part = c.middleRows(start, len);
      if (accumulate) part.noalias() += a.middleRows(start, len) * b;
      else part.noalias() = a.middleRows(start, len) * b;
    } else {
      auto part = c.middleCols(start, len);
      if (accumulate) part.noalias() += a * b.middleCols(start, len);
      else part.noalias() = a * b.middleCols(start, len);
    }
  }
}

}  // namespace linum::kernels::detail
