// Linum: Flax-style functional neural-network modules for C++, with lifted rematerialization.
// Include this header for everything, or the individual <linum/core/...> headers.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/engine.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/warnings.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/memory_timeline.hpp>
#include <linum/core/shape.hpp>
#include <linum/rng/rng.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/ops.hpp>
#include <linum/core/tree.hpp>
#include <linum/core/serialization.hpp>
#include <linum/core/optim.hpp>
#include <linum/core/metrics.hpp>
#include <linum/core/dist/communicator.hpp>
#include <linum/core/dist/data_parallel.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/modules/scope.hpp>
#include <linum/modules/module.hpp>
#include <linum/modules/nn/nn.hpp>
#include <linum/lift/checkpoint.hpp>
#include <linum/lift/policies.hpp>
#include <linum/lift/remat.hpp>
#include <linum/lift/residuals.hpp>
#include <linum/lift/scan.hpp>
#include <linum/lift/remat_scan.hpp>
#include <linum/lift/schedule.hpp>
#include <linum/lift/checkpoint_sequential.hpp>
#include <linum/lift/remat_scope.hpp>
#include <linum/lift/plan.hpp>
