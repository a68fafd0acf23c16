// Everything in linum::rng: JAX-compatible keys and bits (key.hpp), samplers (random.hpp),
// XLA's float32 erf/erf_inv (xla_math.hpp) and Flax-style named streams (streams.hpp).
#pragma once

#include <linum/rng/key.hpp>
#include <linum/rng/random.hpp>
#include <linum/rng/streams.hpp>
#include <linum/rng/xla_math.hpp>
