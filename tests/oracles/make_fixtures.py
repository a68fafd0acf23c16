#!/usr/bin/env python3
"""Writes the oracle fixtures Linum's test suite compares against: values computed by the real
JAX, Flax and optax (the versions pinned below), stored as Flax MessagePack files in fixtures/.

    pip install jax==0.10.2 flax==0.12.8 optax==0.2.8
    python3 tests/oracles/make_fixtures.py            # rewrites tests/oracles/fixtures/*.msgpack

The suite itself never runs Python: it reads the committed files (tests/test_oracles.cpp). Re-run
this script to refresh them after changing a case; the files are deterministic (same bytes on every
run of the same versions on a CPU).

Files (each a nested dict of numpy arrays, written with flax.serialization.msgpack_serialize):
  prng.msgpack           jax.random: keys, split, fold_in, bits and every sampler Linum has, in
                         both threefry modes (partitionable, JAX's default, and legacy)
  initializers.msgpack   jax.nn.initializers from one key (shapes with several fans)
  layers.msgpack         flax.linen layers: init from one key (names, shapes, dtypes, values), apply
                         outputs and gradients (of sum(outputs * cotangents)) with respect to the
                         params and float inputs, f32 and bf16 computation; mutable collections
  optax.msgpack          optax optimizers over 5 steps (params after each step, the final state as
                         flax.serialization.to_state_dict gives it) and schedules at steps 0..N;
                         under "objective", the optimizers that read the objective (polyak_sgd,
                         lbfgs, the backtracking linesearch) over 8 steps of a real objective
  lifted.msgpack         nn.scan (stacked and broadcast params, reverse), nn.remat, nn.remat_scan
                         and nn.while_loop over blocks that draw dropout masks: variable layouts,
                         outputs (the masks drawn inside the lifted transforms) and gradients
  residuals.msgpack      jax.checkpoint under each policy: the residuals saved (shape and kind:
                         argument, named value, product output), from jax's saved_residuals
  flax_bytes.msgpack     flax.serialization.to_bytes of every layer case's variables (uint8 arrays)
  serialization.msgpack  flax.serialization.msgpack_serialize of a tree with every dtype Linum keeps
                         (Linum must write the same bytes and read it back bit for bit)

Integers that do not fit int32 (uint32 key words and bits) are stored as int32 with the same bits.
"""
import argparse
import os
import sys

import numpy as np

PINNED = {"jax": "0.10.2", "flax": "0.12.8", "optax": "0.2.8"}

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import flax.serialization  # noqa: E402
import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def np_tree(tree):
    """The tree with every leaf a numpy array (jax arrays and Python numbers converted)."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {str(k): np_tree(v) for k, v in tree.items()}
    if hasattr(tree, "dtype") and jax.dtypes.issubdtype(tree.dtype, jax.dtypes.prng_key):
        return key_words(tree)  # a typed PRNG key (optax's DP state): its words, as int32 bits
    return np.asarray(tree)


def u32_as_i32(x):
    return np.asarray(x, dtype=np.uint32).view(np.int32)


def key_words(key):
    return u32_as_i32(jax.random.key_data(key))


def write(name, tree):
    data = flax.serialization.msgpack_serialize(np_tree(tree))
    path = os.path.join(HERE, "fixtures", name)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    print(f"{path}: {len(data)} bytes")


def fixed_normal(seed, shape, dtype=np.float32):
    """Inputs and cotangents: numpy's generator, so they do not depend on jax.random."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---- jax.random ---------------------------------------------------------------------------------

def prng_values():
    out = {}
    for mode, partitionable in (("partitionable", True), ("legacy", False)):
        jax.config.update("jax_threefry_partitionable", partitionable)
        m = {}
        for seed in (0, 42, -7, 2**40 + 3):
            k = jax.random.key(seed)
            name = f"seed_{seed}".replace("-", "m")
            c = {"key": key_words(k), "split3": key_words(jax.random.split(k, 3)),
                 "split2": key_words(jax.random.split(k)), "fold_in_7": key_words(jax.random.fold_in(k, 7)),
                 "fold_in_big": key_words(jax.random.fold_in(k, 0xDEADBEEF)),
                 "bits_u32_13": u32_as_i32(jax.random.bits(k, (13,), jnp.uint32)),
                 "bits_u32_2x3": u32_as_i32(jax.random.bits(k, (2, 3), jnp.uint32)),
                 "uniform_7": jax.random.uniform(k, (7,)),
                 "uniform_m2_3_2x5": jax.random.uniform(k, (2, 5), minval=-2.0, maxval=3.0),
                 "normal_9": jax.random.normal(k, (9,)),
                 "normal_3x4": jax.random.normal(k, (3, 4)),
                 "truncated_normal_m2_2_9": jax.random.truncated_normal(k, -2.0, 2.0, (9,)),
                 "truncated_normal_m1_3_9": jax.random.truncated_normal(k, -1.0, 3.0, (9,)),
                 "bernoulli_03_17": jax.random.bernoulli(k, 0.3, (17,)).astype(np.int32),
                 "randint_m5_9_11": jax.random.randint(k, (11,), -5, 9).astype(np.int32),
                 "permutation_10": jax.random.permutation(k, 10).astype(np.int32),
                 "gumbel_6": jax.random.gumbel(k, (6,)),
                 "categorical_4x5": jax.random.categorical(k, jnp.asarray(fixed_normal(5, (4, 5)))).astype(np.int32),
                 }
            m[name] = c
        with jax.enable_x64(True):  # seeds as 64 bits: [hi, lo] = [seed >> 32, seed & 0xffffffff]
            for seed in (0, 42, -7, 2**40 + 3):
                m[f"seed_{seed}".replace("-", "m")]["key_x64"] = key_words(jax.random.key(seed))
        m["categorical_logits_4x5"] = fixed_normal(5, (4, 5))
        out[mode] = m
    jax.config.update("jax_threefry_partitionable", True)
    return out


# ---- jax.nn.initializers ------------------------------------------------------------------------

def initializer_values():
    init = jax.nn.initializers
    k = jax.random.key(3)
    cases = {
        "lecun_normal": init.lecun_normal(), "lecun_uniform": init.lecun_uniform(),
        "he_normal": init.he_normal(), "he_uniform": init.he_uniform(),
        "glorot_normal": init.glorot_normal(), "glorot_uniform": init.glorot_uniform(),
        "normal_002": init.normal(0.02), "uniform_005": init.uniform(0.05),
        "truncated_normal_01": init.truncated_normal(0.1),
        "orthogonal": init.orthogonal(), "orthogonal_2": init.orthogonal(scale=2.0),
    }
    out = {}
    for name, f in cases.items():
        out[name] = {"shape_5x7": f(k, (5, 7), jnp.float32), "shape_3x3x4x6": f(k, (3, 3, 4, 6), jnp.float32)}
    # flax's default embedding init: variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)
    out["embed_default"] = {"shape_10x4": nn.linear.default_embed_init(k, (10, 4), jnp.float32)}
    return out


# ---- flax.linen layers --------------------------------------------------------------------------

def float_leaf(x):
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def layer_case(module, inputs, *, init_rngs=None, apply_rngs=None, mutable=None, call=None, grad=jax.grad):
    """init from key(0) ('params'; extra streams in init_rngs), apply on those variables, gradients of
    sum(output_i * cotangent_i) with respect to the params and every float input (by `grad`: forward
    mode, jax.jacfwd, where JAX has no reverse mode, as through a while loop)."""
    rngs = {"params": jax.random.key(0), **(init_rngs or {})}
    call = call or (lambda mdl, *xs: mdl(*xs))
    variables = module.init(rngs, *inputs, method=lambda mdl, *xs: call(mdl, *xs))
    variables = flax.core.unfreeze(variables)
    params = variables.get("params", {})
    rest = {k: v for k, v in variables.items() if k != "params"}

    def run(p, *xs):
        kwargs = {"rngs": apply_rngs} if apply_rngs else {}
        vars_ = {**rest, "params": p} if p or "params" in variables else dict(rest)
        if mutable:
            out, upd = module.apply(vars_, *xs, mutable=mutable, method=lambda mdl, *a: call(mdl, *a), **kwargs)
        else:
            out, upd = module.apply(vars_, *xs, method=lambda mdl, *a: call(mdl, *a), **kwargs), {}
        return out, upd

    out, updates = run(params, *inputs)
    leaves = jax.tree_util.tree_leaves(out)
    cots = [fixed_normal(100 + i, np.shape(l)) for i, l in enumerate(leaves)]
    diff = [i for i, x in enumerate(inputs) if float_leaf(x)]

    def loss(p, *diff_xs):
        xs = list(inputs)
        for i, x in zip(diff, diff_xs):
            xs[i] = x
        o, _ = run(p, *xs)
        return sum(jnp.sum(l.astype(jnp.float32) * c) for l, c in zip(jax.tree_util.tree_leaves(o), cots))

    grads = grad(loss, argnums=tuple(range(1 + len(diff))))(params, *[inputs[i] for i in diff])
    case = {
        "inputs": {str(i): x for i, x in enumerate(inputs)},
        "variables": variables,
        "outputs": {str(i): l for i, l in enumerate(leaves)},
        "cotangents": {str(i): c for i, c in enumerate(cots)},
        "grad_params": grads[0],
        "grad_inputs": {str(i): g for i, g in zip(diff, grads[1:])},
    }
    if updates:
        case["updates"] = flax.core.unfreeze(updates)
    return case


class InParent(nn.Module):
    """A wrapper made inside a parent, as users write it: the wrapped layer stays bound to the parent
    (params/Dense_0 beside params/WeightNorm_0). `make` builds the wrapper; `call` runs it."""
    make: object
    call: object = None

    @nn.compact
    def __call__(self, x):
        wrapper = self.make()
        return wrapper(x) if self.call is None else self.call(wrapper, x)


def layer_values():
    bf16 = jnp.bfloat16
    x24 = fixed_normal(1, (2, 4))
    img = fixed_normal(2, (2, 6, 6, 3))
    seq = fixed_normal(3, (2, 5, 6))
    feat = fixed_normal(4, (3, 6))
    ids = np.array([[1, 5, 9], [0, 3, 3]], dtype=np.int32)
    padded = fixed_normal(31, (4, 6, 3))
    lengths = np.array([6, 2, 1, 4], dtype=np.int32)
    cases = {
        "dense": layer_case(nn.Dense(3), [x24]),
        "dense_no_bias": layer_case(nn.Dense(5, use_bias=False), [x24]),
        "dense_general": layer_case(nn.DenseGeneral(features=(2, 3), axis=-1), [seq]),
        "dense_general_axes": layer_case(nn.DenseGeneral(features=4, axis=(-2, -1)), [seq]),
        "conv_same": layer_case(nn.Conv(4, (3, 3)), [img]),
        "conv_valid_strided": layer_case(nn.Conv(5, (3, 2), strides=(2, 1), padding="VALID"), [img]),
        "conv_dilated_pairs": layer_case(nn.Conv(2, (2, 2), kernel_dilation=(2, 1), padding=((1, 2), (0, 1))), [img]),
        "conv_grouped": layer_case(nn.Conv(6, (3, 3), feature_group_count=3, use_bias=False), [img]),
        "conv1d_causal": layer_case(nn.Conv(3, (3,), padding="CAUSAL"), [seq]),
        "conv_transpose": layer_case(nn.ConvTranspose(3, (3, 3), strides=(2, 2)), [img]),
        "conv_transpose_valid": layer_case(nn.ConvTranspose(2, (2, 3), strides=(2, 1), padding="VALID"), [img]),
        "embed": layer_case(nn.Embed(10, 4), [ids]),
        "layer_norm": layer_case(nn.LayerNorm(), [seq]),
        "rms_norm": layer_case(nn.RMSNorm(), [seq]),
        "group_norm": layer_case(nn.GroupNorm(num_groups=3), [fixed_normal(5, (2, 4, 4, 6))]),
        "batch_norm_train": layer_case(nn.BatchNorm(use_running_average=False), [feat], mutable=["batch_stats"]),
        "batch_norm_eval": layer_case(nn.BatchNorm(use_running_average=True), [feat]),
        "attention": layer_case(nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8), [seq]),
        "attention_cross": layer_case(nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=6, out_features=5),
                                      [seq, fixed_normal(6, (2, 7, 4))],
                                      call=lambda m, q, kv: m(q, inputs_kv=kv)),
        "lstm_cell": layer_case(nn.LSTMCell(5), [(fixed_normal(7, (2, 5)), fixed_normal(8, (2, 5))), x24]),
        "optimized_lstm_cell": layer_case(nn.OptimizedLSTMCell(5), [(fixed_normal(7, (2, 5)), fixed_normal(8, (2, 5))), x24]),
        "gru_cell": layer_case(nn.GRUCell(5), [fixed_normal(9, (2, 5)), x24]),
        "simple_cell": layer_case(nn.SimpleCell(5), [fixed_normal(9, (2, 5)), x24]),
        "rnn_lstm": layer_case(nn.RNN(nn.LSTMCell(4)), [seq]),
        "rnn_gru_reverse": layer_case(nn.RNN(nn.GRUCell(3), reverse=True, keep_order=True), [seq]),
        # seq_lengths (a length of 1, the full 6, others), return_carry: each row's carry at its length.
        "rnn_lstm_lengths": layer_case(nn.RNN(nn.LSTMCell(4)), [padded, lengths],
                                       call=lambda m, x, n: m(x, seq_lengths=n, return_carry=True)),
        "rnn_gru_reverse_lengths": layer_case(nn.RNN(nn.GRUCell(3), reverse=True, keep_order=True), [padded, lengths],
                                              call=lambda m, x, n: m(x, seq_lengths=n, return_carry=True)),
        "dropout": layer_case(nn.Dropout(0.5, deterministic=False), [fixed_normal(10, (4, 6))],
                              apply_rngs={"dropout": jax.random.key(1)}),
        "dropout_broadcast": layer_case(nn.Dropout(0.3, broadcast_dims=(0,), deterministic=False),
                                        [fixed_normal(10, (4, 6))], apply_rngs={"dropout": jax.random.key(2)}),
        # bf16 computation, float32 params (Flax's dtype / param_dtype)
        "dense_bf16": layer_case(nn.Dense(3, dtype=bf16), [x24]),
        "conv_bf16": layer_case(nn.Conv(4, (3, 3), dtype=bf16), [img]),
        "layer_norm_bf16": layer_case(nn.LayerNorm(dtype=bf16), [seq]),
        "attention_bf16": layer_case(nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, dtype=bf16), [seq]),
        "lstm_cell_bf16": layer_case(nn.LSTMCell(5, dtype=bf16), [(fixed_normal(7, (2, 5)), fixed_normal(8, (2, 5))), x24]),
        "rnn_lstm_bf16": layer_case(nn.RNN(nn.LSTMCell(4, dtype=bf16)), [seq]),
        "rnn_gru_bf16": layer_case(nn.RNN(nn.GRUCell(3, dtype=bf16)), [seq]),
        # more layers: InstanceNorm, Einsum, the MGU and convolutional LSTM cells, Bidirectional
        "instance_norm": layer_case(nn.InstanceNorm(), [fixed_normal(5, (2, 4, 4, 6))]),
        "instance_norm_bf16": layer_case(nn.InstanceNorm(dtype=bf16), [fixed_normal(5, (2, 4, 4, 6))]),
        "einsum": layer_case(nn.Einsum((6, 2, 3), "btd,dhk->bthk"), [seq]),
        "einsum_ellipsis": layer_case(nn.Einsum((6, 4), "...d,dk->...k"), [seq]),
        "einsum_bf16": layer_case(nn.Einsum((6, 2, 3), "btd,dhk->bthk", dtype=bf16), [seq]),
        "mgu_cell": layer_case(nn.MGUCell(5), [fixed_normal(9, (2, 5)), x24]),
        "mgu_cell_no_reset": layer_case(nn.MGUCell(5, reset_gate=False), [fixed_normal(9, (2, 5)), x24]),
        "rnn_mgu": layer_case(nn.RNN(nn.MGUCell(3)), [seq]),
        "conv_lstm_cell": layer_case(nn.ConvLSTMCell(3, (3, 3)),
                                     [(fixed_normal(11, (2, 6, 6, 3)), fixed_normal(12, (2, 6, 6, 3))), img]),
        "rnn_conv_lstm": layer_case(nn.RNN(nn.ConvLSTMCell(2, (3, 3))), [fixed_normal(13, (2, 3, 5, 5, 3))]),
        "bidirectional": layer_case(nn.Bidirectional(nn.RNN(nn.LSTMCell(4)), nn.RNN(nn.GRUCell(3))), [seq]),
        "bidirectional_lengths": layer_case(nn.Bidirectional(nn.RNN(nn.GRUCell(3)), nn.RNN(nn.MGUCell(2))),
                                            [padded, lengths],
                                            call=lambda m, x, n: m(x, seq_lengths=n, return_carry=True)),
        # locally connected (unshared) convolutions
        "conv_local": layer_case(nn.ConvLocal(3, (3, 3)), [img]),
        "conv_local_strided_valid": layer_case(nn.ConvLocal(2, (2, 3), strides=(2, 1), padding="VALID"), [img]),
        "conv_local_1d_dilated": layer_case(nn.ConvLocal(4, (3,), kernel_dilation=(2,)), [seq]),
        # weight reparametrizations, the wrapped layer bound to a parent module
        "weight_norm": layer_case(InParent(lambda: nn.WeightNorm(nn.Dense(4))), [x24]),
        "weight_norm_every_variable": layer_case(InParent(lambda: nn.WeightNorm(nn.Dense(4), variable_filter=None)), [x24]),
        "weight_norm_conv_one_scale": layer_case(InParent(lambda: nn.WeightNorm(nn.Conv(3, (3, 3)), feature_axes=None)),
                                                 [img]),
        "spectral_norm": layer_case(InParent(lambda: nn.SpectralNorm(nn.Dense(4)), lambda w, x: w(x, update_stats=True)),
                                    [x24], mutable=["batch_stats"]),
        "spectral_norm_conv_3_steps": layer_case(
            InParent(lambda: nn.SpectralNorm(nn.Conv(3, (3, 3)), n_steps=3), lambda w, x: w(x, update_stats=True)),
            [img], mutable=["batch_stats"]),
        "spectral_norm_eval": layer_case(InParent(lambda: nn.SpectralNorm(nn.Dense(4)),
                                                  lambda w, x: w(x, update_stats=False)), [x24]),
    }
    return cases


def tuples_to_dicts(tree):
    if isinstance(tree, dict):
        return {k: tuples_to_dicts(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return {str(i): tuples_to_dicts(v) for i, v in enumerate(tree)}
    return tree


# ---- lifted transforms: nn.scan, nn.remat, nn.remat_scan with dropout ----------------------------

class DropBlock(nn.Module):
    """carry, x -> (tanh(h), h) with h = dropout(Dense(carry) + x): keys drawn inside the lift."""
    @nn.compact
    def __call__(self, c, x):
        h = nn.Dense(5)(c) + x
        h = nn.Dropout(0.5, deterministic=False)(h)
        return jnp.tanh(h), h


class ScanStacked(nn.Module):
    """Layers: params stacked along axis 0, params and dropout keys split per iteration."""
    @nn.compact
    def __call__(self, c, xs):
        return nn.scan(DropBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True})()(c, xs)


class ScanShared(nn.Module):
    """An RNN: params broadcast (one set), dropout keys split per step."""
    @nn.compact
    def __call__(self, c, xs):
        return nn.scan(DropBlock, variable_broadcast="params", split_rngs={"params": False, "dropout": True})()(c, xs)


class ScanReverse(nn.Module):
    @nn.compact
    def __call__(self, c, xs):
        return nn.scan(DropBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       reverse=True)()(c, xs)


class RematBlocks(nn.Module):
    """Two rematted blocks and a plain one, each drawing its dropout mask."""
    @nn.compact
    def __call__(self, c, x):
        RB = nn.remat(DropBlock)
        c, h1 = RB()(c, x)
        c, h2 = RB()(c, x)
        c, h3 = DropBlock()(c, x)
        return c, h1 + h2 + h3


class ResBlock(nn.Module):
    """carry -> carry + dropout(tanh(Dense(carry)))."""
    @nn.compact
    def __call__(self, c):
        return c + nn.Dropout(0.25, deterministic=False)(jnp.tanh(nn.Dense(5)(c)))


class RematScan(nn.Module):
    @nn.compact
    def __call__(self, c):
        return nn.remat_scan(ResBlock, lengths=(2, 3))()(c)


class WhileDrop(nn.Module):
    """nn.while_loop of three iterations (the count in the carry) over h -> dropout(tanh(Dense(h))) + h,
    dropout keys split per iteration. At init the body runs once, as Flax's documentation has users
    do (a while loop cannot create variables)."""
    @nn.compact
    def __call__(self, c):
        def cond_fn(mdl, carry):
            return carry[1] < 3

        def body_fn(mdl, carry):
            h, i = carry
            return nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(5)(h))) + h, i + 1

        carry = (c, jnp.zeros((), jnp.float32))
        if self.is_initializing():
            return body_fn(self, carry)[0]
        return nn.while_loop(cond_fn, body_fn, self, carry, split_rngs={"dropout": True})[0]


def lifted_values():
    c = fixed_normal(50, (2, 5))
    xs = fixed_normal(51, (4, 2, 5))
    x = fixed_normal(52, (2, 5))
    drop = {"dropout": jax.random.key(7)}
    init_rngs = {"dropout": jax.random.key(8)}
    return {
        "scan_stacked": layer_case(ScanStacked(), [c, xs], init_rngs=init_rngs, apply_rngs=drop),
        "scan_shared": layer_case(ScanShared(), [c, xs], init_rngs=init_rngs, apply_rngs=drop),
        "scan_reverse": layer_case(ScanReverse(), [c, xs], init_rngs=init_rngs, apply_rngs=drop),
        "remat_blocks": layer_case(RematBlocks(), [c, x], init_rngs=init_rngs, apply_rngs=drop),
        "remat_scan": layer_case(RematScan(), [c], init_rngs=init_rngs, apply_rngs=drop),
        "while_loop": layer_case(WhileDrop(), [c], init_rngs=init_rngs, apply_rngs=drop, grad=jax.jacfwd),
    }


# ---- jax.checkpoint policies: what is saved ------------------------------------------------------

def residual_block(x, w1, w2, w3):
    """Two plain products and a batched one, a named value, elementwise ops between."""
    from jax.ad_checkpoint import checkpoint_name
    h = checkpoint_name(jnp.tanh(x @ w1), "h")
    g = jnp.sin(h @ w2)
    b = jnp.einsum("bij,bjk->bik", g.reshape(2, 2, 3), w3)  # a dot_general with a batch dimension
    return jnp.exp(b)


def residual_values():
    from jax._src.ad_checkpoint import saved_residuals
    pol = jax.checkpoint_policies
    x, w1, w2, w3 = fixed_normal(60, (4, 3)), fixed_normal(61, (3, 5)), fixed_normal(62, (5, 3)), fixed_normal(63, (2, 3, 2))
    policies = {"nothing_saveable": pol.nothing_saveable, "dots_saveable": pol.dots_saveable,
                "dots_with_no_batch_dims_saveable": pol.dots_with_no_batch_dims_saveable,
                "save_only_these_names_h": pol.save_only_these_names("h"),
                "save_any_names_but_these_h": pol.save_any_names_but_these("h")}
    out = {"inputs": {"0": x, "1": w1, "2": w2, "3": w3}}
    for name, p in policies.items():
        f = jax.checkpoint(residual_block, policy=p)
        res = saved_residuals(lambda *a: jnp.sum(f(*a)), x, w1, w2, w3)
        # Each residual: its shape and a kind: 0 an argument, 1 a named value, 2 a product's output.
        entries = {}
        for i, (aval, desc) in enumerate(res):
            kind = 0 if desc.startswith("from the argument") else 1 if desc.startswith("named") else \
                2 if "dot_general" in desc else 3
            entries[str(i)] = {"shape": np.asarray(aval.shape, np.int32), "kind": np.int32(kind)}
        out[name] = entries
    return out


# ---- optax --------------------------------------------------------------------------------------

SCHEDULES = {
    "constant": lambda: optax.constant_schedule(0.3),
    "linear": lambda: optax.linear_schedule(1.0, 0.1, transition_steps=7, transition_begin=2),
    "cosine_decay": lambda: optax.cosine_decay_schedule(0.5, decay_steps=9, alpha=0.1),
    "warmup_cosine_decay": lambda: optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=3, decay_steps=10,
                                                                      end_value=0.05),
    "exponential_decay": lambda: optax.exponential_decay(1.0, transition_steps=3, decay_rate=0.5),
    "exponential_decay_staircase": lambda: optax.exponential_decay(1.0, transition_steps=3, decay_rate=0.5,
                                                                   transition_begin=1, staircase=True, end_value=0.2),
    "piecewise_constant": lambda: optax.piecewise_constant_schedule(1.0, {3: 0.5, 7: 0.1}),
    "polynomial": lambda: optax.polynomial_schedule(1.0, 0.01, power=2.0, transition_steps=8, transition_begin=1),
    "join": lambda: optax.join_schedules([optax.constant_schedule(0.1), optax.linear_schedule(0.1, 1.0, 5)], [4]),
    "cosine_onecycle": lambda: optax.cosine_onecycle_schedule(12, peak_value=1.0),
}

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adam_eps_root": lambda: optax.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-8),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "rmsprop_centered": lambda: optax.rmsprop(1e-2, centered=True),
    "rmsprop_eps_outside": lambda: optax.rmsprop(1e-2, eps_in_sqrt=False),
    "adagrad": lambda: optax.adagrad(0.1),
    "lion": lambda: optax.lion(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "adam_schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5)),
    # the toolbox Linum has, each in a chain where it is not a whole optimizer
    "trace_nesterov": lambda: optax.chain(optax.trace(0.9, nesterov=True), optax.scale(-0.1)),
    "scale_by_rss": lambda: optax.chain(optax.scale_by_rss(), optax.scale(-0.1)),
    "scale_by_stddev": lambda: optax.chain(optax.scale_by_stddev(), optax.scale(-0.01)),
    "trust_ratio": lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-0.01)),
    "adafactor_factored": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.5), optax.scale(-0.1)),
    "param_block_rms": lambda: optax.chain(optax.scale_by_param_block_rms(), optax.scale(-0.1)),
    "ema": lambda: optax.chain(optax.ema(0.9), optax.scale(-0.1)),
    "ema_no_debias": lambda: optax.chain(optax.ema(0.8, debias=False), optax.scale(-0.1)),
    "masked_adam": lambda: optax.masked(optax.adam(1e-2), {"b": False, "w": True}),
    "decay_masked": lambda: optax.chain(optax.add_decayed_weights(0.1, mask={"b": False, "w": True}), optax.sgd(0.1)),
    "scale_by_schedule": lambda: optax.chain(optax.scale_by_schedule(optax.linear_schedule(-0.1, -0.01, 4))),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
    "dpsgd": lambda: optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=3),
    # the other adaptive optimizers
    "nadam": lambda: optax.nadam(1e-2),
    "nadamw": lambda: optax.nadamw(1e-2, weight_decay=0.1),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "amsgrad_no_bias_correction": lambda: optax.amsgrad(1e-2, bias_correction_mu=False, bias_correction_nu=False),
    "adamax": lambda: optax.adamax(1e-2),
    # RAdam with b2 = 0.999 stays on its momentum branch for 5 steps; with b2 = 0.9 and threshold 4
    # the rectified branch takes over at step 5 (ro = 4.58).
    "radam": lambda: optax.radam(1e-2),
    "radam_rectified": lambda: optax.radam(1e-2, b2=0.9, threshold=4.0),
    "radam_rectified_nesterov": lambda: optax.radam(1e-2, b2=0.9, threshold=4.0, nesterov=True),
    "yogi": lambda: optax.yogi(1e-2),
    "adadelta": lambda: optax.adadelta(0.5),
    "adadelta_decay_masked": lambda: optax.adadelta(0.5, weight_decay=0.1, weight_decay_mask={"b": False, "w": True}),
    "novograd": lambda: optax.novograd(1e-2, weight_decay=0.01),
    "lars": lambda: optax.lars(0.1, weight_decay=0.01),
    "lars_masked": lambda: optax.lars(0.1, weight_decay=0.01, weight_decay_mask={"b": False, "w": True},
                                      trust_ratio_mask={"b": False, "w": True}, nesterov=True),
    # more of optax's optimizers
    "adan": lambda: optax.adan(1e-2),
    "adan_decay_masked": lambda: optax.adan(1e-2, weight_decay=0.1, mask={"b": False, "w": True}),
    "adamaxw": lambda: optax.adamaxw(1e-2),
    "sign_sgd": lambda: optax.sign_sgd(0.1),
    "sm3": lambda: optax.sm3(0.1),
    "fromage": lambda: optax.fromage(0.1),
    # clipping, constraints, noise, optimistic gradients
    "clip": lambda: optax.chain(optax.clip(0.5), optax.scale(-0.1)),
    "adaptive_grad_clip": lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1)),
    "centralize": lambda: optax.chain(optax.centralize(), optax.sgd(0.1)),
    "keep_params_nonnegative": lambda: optax.chain(optax.sgd(0.5), optax.keep_params_nonnegative()),
    "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.sgd(0.1)),
    "frozen_w": lambda: optax.chain(optax.sgd(0.1), optax.masked(optax.set_to_zero(), {"b": False, "w": True})),
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=3),
    "optimistic_gd": lambda: optax.optimistic_gradient_descent(0.1),
    "optimistic_gd_ab": lambda: optax.optimistic_gradient_descent(0.1, alpha=0.5, beta=0.3),
    "multi_transform": lambda: optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)},
                                                     {"b": "sgd", "w": "adam"}),
}

# Which gradients a trajectory takes: "grads" by default, with a NaN at step 2, or per example
# (3 examples; DP-SGD clips each).
GRADS_OF = {"apply_if_finite": "grads_nan", "zero_nans": "grads_nan", "dpsgd": "grads_per_example"}

STEPS = 5


# Optimizers that read the objective (optax's extra args: value, grad, value_fn), run on a real
# objective instead of fixed gradients: f(p) = sum over the leaves of 0.5 a (p - t)^2 + 0.1 p^4.
OBJECTIVE_OPTIMIZERS = {
    "polyak_sgd": lambda: optax.polyak_sgd(),
    "polyak_sgd_plus": lambda: optax.polyak_sgd(max_learning_rate=0.5, scaling=0.8, f_min=0.5, eps=1e-3, variant="sps+"),
    "lbfgs_lr": lambda: optax.lbfgs(learning_rate=0.1, linesearch=None),
    "lbfgs_unscaled_lr": lambda: optax.lbfgs(learning_rate=0.05, memory_size=3, scale_init_precond=False, linesearch=None),
    "lbfgs_backtracking": lambda: optax.lbfgs(linesearch=optax.scale_by_backtracking_linesearch(max_backtracking_steps=20)),
    "lbfgs_memory_2": lambda: optax.lbfgs(memory_size=2,
                                          linesearch=optax.scale_by_backtracking_linesearch(max_backtracking_steps=20)),
    "sgd_backtracking": lambda: optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(
        max_backtracking_steps=15, decrease_factor=0.5, increase_factor=2.0, max_learning_rate=4.0, slope_rtol=0.3)),
}
OBJECTIVE_STEPS = 8


def objective_coefficients():
    return ({"b": np.abs(fixed_normal(80, (4,))) + 0.5, "w": np.abs(fixed_normal(81, (3, 4))) + 0.5},
            {"b": fixed_normal(82, (4,)), "w": fixed_normal(83, (3, 4))})


def objective_values(params):
    a, t = objective_coefficients()

    def f(p):
        return sum(jnp.sum(0.5 * a[k] * (p[k] - t[k]) ** 2 + 0.1 * p[k] ** 4) for k in ("b", "w"))

    out = {"a": a, "t": t}
    for name, make in OBJECTIVE_OPTIMIZERS.items():
        opt = make()
        p = jax.tree_util.tree_map(jnp.asarray, params)
        state = opt.init(p)
        traj, values = {}, []
        for s in range(OBJECTIVE_STEPS):
            value, grad = jax.value_and_grad(f)(p)
            updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=f)
            p = optax.apply_updates(p, updates)
            traj[str(s)] = p
            values.append(np.float32(f(p)))
        # optax's None (the linesearch's unstored gradient) is Linum's empty dict.
        state = nones_to_dicts(flax.serialization.to_state_dict(state))
        out[name] = {"params": traj, "values": np.asarray(values, np.float32), "state": state}
    return out


def nones_to_dicts(tree):
    if tree is None:
        return {}
    if isinstance(tree, dict):
        return {k: nones_to_dicts(v) for k, v in tree.items()}
    return tree


def optax_values():
    params = {"b": fixed_normal(20, (4,)), "w": fixed_normal(21, (3, 4))}
    grads = [{"b": fixed_normal(30 + 2 * s, (4,)), "w": fixed_normal(31 + 2 * s, (3, 4))} for s in range(STEPS)]
    grads_nan = [dict(g) for g in grads]
    grads_nan[2] = {"b": np.array([1.0, np.nan, 0.5, 2.0], np.float32), "w": grads[2]["w"]}
    grads_per_example = [{"b": fixed_normal(70 + 2 * s, (3, 4)), "w": fixed_normal(71 + 2 * s, (3, 3, 4))}
                         for s in range(STEPS)]
    sets = {"grads": grads, "grads_nan": grads_nan, "grads_per_example": grads_per_example}
    out = {"params0": params, "optimizers": {}, "schedules": {},
           **{k: {str(s): g for s, g in enumerate(v)} for k, v in sets.items()}}
    for name, make in OPTIMIZERS.items():
        opt = make()
        gs = sets[GRADS_OF.get(name, "grads")]
        p = jax.tree_util.tree_map(jnp.asarray, params)
        state = opt.init(p)
        traj = {}
        for s in range(STEPS):
            updates, state = opt.update(jax.tree_util.tree_map(jnp.asarray, gs[s]), state, p)
            p = optax.apply_updates(p, updates)
            traj[str(s)] = p
        out["optimizers"][name] = {"params": traj, "state": flax.serialization.to_state_dict(state)}
    for name, make in SCHEDULES.items():
        f = make()
        out["schedules"][name] = np.asarray([f(s) for s in range(15)], dtype=np.float32)
    out["objective"] = objective_values(params)
    return out


# ---- flax.serialization -------------------------------------------------------------------------

def serialization_tree():
    return {
        "params": {
            "Dense_0": {"kernel": fixed_normal(40, (3, 2)), "bias": np.zeros((2,), np.float32)},
            "Embed_0": {"embedding": fixed_normal(41, (5, 3)).astype(jnp.bfloat16)},
        },
        "batch_stats": {"mean": np.arange(4, dtype=np.float32) / 3, "var": np.ones((4,), np.float32)},
        "step": np.array(7, dtype=np.int32),
        "ids": np.array([[1, -2], [2**31 - 1, -(2**31)]], dtype=np.int32),
        "specials": np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45, 3.4028235e38], dtype=np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "nested": {"a": {"b": {"c": np.float32(1.5) * np.ones((1, 1, 1), np.float32)}}},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--any-version", action="store_true", help="run with other versions than the pinned ones")
    ap.add_argument("--only", choices=list(FIXTURES),
                    help="write only this fixture")
    ap.add_argument("--add-only", action="store_true",
                    help="keep every value already in the fixture files and add only the new cases (XLA's CPU "
                         "code differs between machines in the last bits, so regenerating moves old values by an ulp)")
    args = ap.parse_args()
    found = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}
    if found != PINNED and not args.any_version:
        sys.exit(f"pinned {PINNED}, found {found}: pip install jax=={PINNED['jax']} flax=={PINNED['flax']} "
                 f"optax=={PINNED['optax']} (or --any-version to compare)")
    jax.config.update("jax_platforms", "cpu")
    os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
    for name, values in FIXTURES.items():
        if args.only in (None, name):
            tree = values(found)
            path = os.path.join(HERE, "fixtures", name + ".msgpack")
            if args.add_only and os.path.exists(path):
                with open(path, "rb") as f:
                    tree = keep_existing(flax.serialization.msgpack_restore(f.read()), np_tree(tree))
            write(name + ".msgpack", tree)


def keep_existing(old, new):
    """`new` with every value `old` already has kept from `old` (dicts merged key by key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: keep_existing(old[k], v) if k in old else v for k, v in new.items()}
    return old


# Each fixture file and what computes it. Tuples (LSTM carries (c, h)) are stored as {"0": c, "1": h}.
FIXTURES = {
    "prng": lambda found: {"versions": {k: np.frombuffer(v.encode(), np.uint8).astype(np.int32)
                                        for k, v in found.items()}, **prng_values()},
    "initializers": lambda found: initializer_values(),
    "layers": lambda found: tuples_to_dicts(layer_values()),
    "lifted": lambda found: tuples_to_dicts(lifted_values()),
    "residuals": lambda found: residual_values(),
    "optax": lambda found: optax_values(),
    "serialization": lambda found: serialization_tree(),
    # flax.serialization.to_bytes of Flax's own init output for every layer case, as uint8 arrays.
    "flax_bytes": lambda found: {name: np.frombuffer(flax.serialization.to_bytes(c["variables"]), np.uint8)
                                 for name, c in tuples_to_dicts(layer_values()).items()},
}


if __name__ == "__main__":
    main()
