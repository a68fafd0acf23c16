// Linum: Flax-style functional neural-network modules for C++, with lifted rematerialization.
// Include this header for everything, or the individual <linum/core/...> headers.
#pragma once

// The library's headers declare nlohmann::json (json_fwd.hpp) where they return or take JSON;
// everything-included means the whole of it, so `plan.to_json().dump()` works here.
#include <nlohmann/json.hpp>

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/kernels/engine.hpp>
#include <linum/core/kernels/product_timing.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/warnings.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/memory_timeline.hpp>
#include <linum/core/profiler.hpp>
#include <linum/core/storage/stored_array.hpp>
#include <linum/core/shape.hpp>
#include <linum/rng/rng.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/jvp.hpp>
#include <linum/core/transforms/jacobians.hpp>
#include <linum/core/transforms/vmap.hpp>
#include <linum/core/autodiff/custom_vjp.hpp>
#include <linum/core/autodiff/saved_hooks.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/core/tree.hpp>
#include <linum/train/io/restore.hpp>
#include <linum/train/io/serialization.hpp>
#include <linum/train/io/safetensors.hpp>
#include <linum/train/io/torch_layouts.hpp>
#include <linum/train/io/checkpoint_manager.hpp>
#include <linum/train/data/array_dataset.hpp>
#include <linum/train/data/data_source.hpp>
#include <linum/train/data/file_dataset.hpp>
#include <linum/train/data/idx.hpp>
#include <linum/train/data/loader.hpp>
#include <linum/train/optim.hpp>
#include <linum/train/square_sums.hpp>
#include <linum/train/metrics.hpp>
#include <linum/train/distributed/communicator.hpp>
#include <linum/train/distributed/data_parallel.hpp>
#include <linum/train/distributed/sharded_data_parallel.hpp>
#include <linum/train/distributed/sharding.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/modules/intercept.hpp>
#include <linum/modules/scope.hpp>
#include <linum/modules/module.hpp>
#include <linum/nn/nn.hpp>
#include <linum/lift/checkpoint.hpp>
#include <linum/lift/policies.hpp>
#include <linum/lift/remat.hpp>
#include <linum/lift/residuals.hpp>
#include <linum/lift/residual_scope.hpp>
#include <linum/lift/scan.hpp>
#include <linum/lift/vmap.hpp>
#include <linum/lift/cond.hpp>
#include <linum/lift/map_variables.hpp>
#include <linum/lift/while_loop.hpp>
#include <linum/lift/remat_scan.hpp>
#include <linum/lift/schedule.hpp>
#include <linum/nn/checkpoint_sequential.hpp>
#include <linum/lift/remat_scope.hpp>
#include <linum/lift/plan.hpp>
