// The standard layers, activations, losses and the model summary, in namespace `linum::nn`
// (Flax's `flax.linen` counterparts). Module configurations as JSON live in
// <linum/modules/nn/config.hpp>, which is not included here because it pulls in Boost.Hana.
#pragma once

#include <linum/modules/nn/activations.hpp>
#include <linum/modules/nn/attention.hpp>
#include <linum/modules/nn/conv.hpp>
#include <linum/modules/nn/dense.hpp>
#include <linum/modules/nn/dtypes.hpp>
#include <linum/modules/nn/dropout.hpp>
#include <linum/modules/nn/embed.hpp>
#include <linum/modules/nn/losses.hpp>
#include <linum/modules/nn/normalization.hpp>
#include <linum/modules/nn/recurrent.hpp>
#include <linum/modules/nn/sequential.hpp>
#include <linum/modules/nn/tabulate.hpp>
