// The standard layers, activations, losses and the model summary, in namespace `linum::nn`
// (Flax's `flax.linen` counterparts). Module configurations as JSON live in
// <linum/nn/config.hpp>, which is not included here because it pulls in Boost.Hana.
#pragma once

#include <linum/nn/activations.hpp>
#include <linum/nn/attention.hpp>
#include <linum/nn/conv.hpp>
#include <linum/nn/dense.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/nn/dropout.hpp>
#include <linum/nn/einsum.hpp>
#include <linum/nn/embed.hpp>
#include <linum/nn/losses.hpp>
#include <linum/nn/normalization.hpp>
#include <linum/nn/partitioning.hpp>
#include <linum/nn/recurrent.hpp>
#include <linum/nn/sequential.hpp>
#include <linum/nn/tabulate.hpp>
#include <linum/nn/spectral_norm.hpp>
#include <linum/nn/weight_norm.hpp>
