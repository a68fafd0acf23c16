"""The main example's model (examples/fashion_mnist/model.hpp: ResNet) in Flax on JAX, as Flax users
train it (jax.jit of the whole step, optax.adam), for comparing accuracy and epoch time on the same
machine (pip: jax, flax, optax).

Usage: python3 flax_cnn.py [--epochs 3] [--batch 128] [--lr 0.001] [--depth 8] [--width 24]
                          [--data DIR] [--dtype f32|bf16] [--remat full|none] [--limit N]
--dtype bf16: modules with dtype=bfloat16 and float32 parameters (Flax's mixed precision, like the
example's --dtype bf16). --remat full wraps the stem and every residual block but the last in
nn.remat, as the example's default. The learning rate halves every epoch, smoothly per step
(optax.exponential_decay), as the example's schedule. --limit N trains on the first N training
images (a quick check). XLA's CPU backend uses every core it sees. Prints progress lines and, last,
one JSON object: {"peer", "dtype", "remat", "test_accuracy", "epochs", "seconds_per_epoch",
"compile_s", "xla_temp_bytes", "xla_temp_bytes_plain"} (seconds_per_epoch leaves out the first
step's tracing and compilation, compile_s; xla_temp_bytes are the temporary buffers, activations and
workspace, XLA's buffer assignment gives the compiled gradient of one batch's loss, with --remat and
without: the peer of the example's peak_activation_bytes with --micro-batches 1, but XLA's static
plan for the whole program, not a measured peak).
"""
import argparse
import gzip
import json
import struct
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batch", type=int, default=128)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--depth", type=int, default=8)
p.add_argument("--width", type=int, default=24)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
p.add_argument("--remat", choices=["full", "none"], default="full")
p.add_argument("--limit", type=int, default=0)
a = p.parse_args()
compute = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32


def load(prefix):
    with gzip.open(f"{a.data}/{prefix}-images-idx3-ubyte.gz") as f:
        _, n, r, c = struct.unpack(">IIII", f.read(16))
        x = np.frombuffer(f.read(), np.uint8).reshape(n, r, c, 1).astype(np.float32) / 255.0
    with gzip.open(f"{a.data}/{prefix}-labels-idx1-ubyte.gz") as f:
        f.read(8)
        y = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    return x, y


class ConvBlock(nn.Module):  # conv 3x3 -> BatchNorm -> ReLU -> 2x2 average pool
    features: int

    @nn.compact
    def __call__(self, x, train):
        h = nn.Conv(self.features, (3, 3), dtype=compute)(x)
        h = nn.BatchNorm(use_running_average=not train, dtype=compute)(h)
        return nn.avg_pool(nn.relu(h), (2, 2), strides=(2, 2))


class ResidualBlock(nn.Module):  # conv -> BN -> ReLU -> conv -> BN, plus the input, then ReLU
    features: int

    @nn.compact
    def __call__(self, x, train):
        y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=compute)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=compute)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=compute)(y)
        y = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=compute)(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        wrap = (lambda m: nn.remat(m, static_argnums=(2,))) if a.remat == "full" else (lambda m: m)
        x = wrap(ConvBlock)(a.width)(x, train)
        for i in range(a.depth):
            x = (ResidualBlock if i + 1 == a.depth else wrap(ResidualBlock))(a.width)(x, train)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(256, dtype=compute)(x))
        return nn.Dense(10, dtype=compute)(x)


xtr, ytr = load("train")
xte, yte = load("t10k")
if a.limit:
    xtr, ytr = xtr[: a.limit], ytr[: a.limit]
model = ResNet()
variables = model.init(jax.random.key(a.seed), jnp.zeros((1, 28, 28, 1)), False)
steps_per_epoch = len(ytr) // a.batch
tx = optax.adam(optax.exponential_decay(a.lr, transition_steps=steps_per_epoch, decay_rate=0.5))
params, batch_stats = variables["params"], variables["batch_stats"]
opt_state = tx.init(params)


@jax.jit
def step(params, batch_stats, opt_state, x, y):
    def loss(p):
        logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, x, True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean(), updates

    (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
    changes, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, changes), updates["batch_stats"], opt_state, value


def grad_temp_bytes(remat):
    """XLA's temporary bytes for the compiled gradient of one batch's loss (no optimizer update)."""
    saved, a.remat = a.remat, remat  # ResNet reads a.remat when it is traced (nn.remat renames the scopes)
    v = model.init(jax.random.key(a.seed), jnp.zeros((1, 28, 28, 1)), False)

    def loss(p, x, y):
        logits, _ = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x, True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    compiled = jax.jit(jax.grad(loss)).lower(v["params"], xtr[: a.batch], ytr[: a.batch]).compile()
    a.remat = saved
    return compiled.memory_analysis().temp_size_in_bytes


memory = {"xla_temp_bytes": grad_temp_bytes(a.remat), "xla_temp_bytes_plain": grad_temp_bytes("none")}


@jax.jit
def predict(params, batch_stats, x):
    return model.apply({"params": params, "batch_stats": batch_stats}, x, False).argmax(-1)


rng = np.random.default_rng(a.seed)
seconds, compile_s = [], None
for epoch in range(a.epochs):
    order = rng.permutation(len(ytr))
    start = time.perf_counter()
    for b in range(0, len(ytr) - a.batch + 1, a.batch):
        idx = order[b:b + a.batch]
        t0 = time.perf_counter()
        params, batch_stats, opt_state, value = step(params, batch_stats, opt_state, xtr[idx], ytr[idx])
        if compile_s is None:
            jax.block_until_ready(value)
            compile_s = time.perf_counter() - t0
            start += compile_s  # the epoch's time leaves the first call's compilation out
    jax.block_until_ready(params)
    seconds.append(time.perf_counter() - start)
    print(f"epoch {epoch + 1}/{a.epochs} {seconds[-1]:.1f} s, last loss {float(value):.4f}", flush=True)
hits = sum(int((predict(params, batch_stats, xte[i:i + 500]) == yte[i:i + 500]).sum()) for i in range(0, len(yte), 500))
print(json.dumps({"peer": f"jax-{jax.__version__}+flax-{flax.__version__}", "dtype": a.dtype, "remat": a.remat,
                  "test_accuracy": hits / len(yte), "epochs": a.epochs, "seconds_per_epoch": sum(seconds) / len(seconds),
                  "compile_s": compile_s, **memory}))
