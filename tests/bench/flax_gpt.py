"""Peer for `linum-bench gpt`: one GPT-style training step (forward + backward + adam) as Flax users
write it: jax.jit over value_and_grad and optax.adam (pip: jax, flax, optax). The model of
torch_gpt.py and gpt_bench.cpp: token + learned position embeddings (normal, std 1/sqrt(d)),
`layers` pre-LayerNorm blocks (causal multi-head self-attention with biases, a 4x tanh-GELU MLP,
residuals; LayerNorm eps 1e-6), a final LayerNorm, a Dense head without bias, softmax
cross-entropy on integer labels, adam(3e-4). Prints one JSON line.

Usage: python3 flax_gpt.py [--variant plain|remat|dots] [--dtype fp32|bf16] [--steps 5]
                           [--layers 8] [--batch 16] [--seq 256]
  plain  no checkpointing
  remat  nn.remat around every block (jax.checkpoint, nothing saved)
  dots   nn.remat with policy=jax.checkpoint_policies.dots_saveable
  bf16   modules with dtype=bfloat16 and float32 parameters (Flax's mixed precision, like
         Linum's --dtype bf16)
XLA's CPU backend uses every core it sees. compile_s is the first call (tracing and XLA
compilation), step_s_min / step_s_median the steady state, xla_temp_bytes the compiled step's
temporary buffers (XLA's memory analysis: its activations and workspace)."""
import argparse
import json
import statistics
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="plain", choices=["plain", "remat", "dots"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    vocab, d, heads = 256, 256, 4
    compute = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            h = nn.LayerNorm(epsilon=1e-6, dtype=compute)(x)
            h = nn.MultiHeadDotProductAttention(num_heads=heads, dtype=compute)(h, h, mask=mask)
            x = x + h
            h = nn.LayerNorm(epsilon=1e-6, dtype=compute)(x)
            h = nn.Dense(4 * d, dtype=compute)(h)
            h = nn.Dense(d, dtype=compute)(nn.gelu(h, approximate=True))
            return x + h

    block = Block
    if a.variant == "remat":
        block = nn.remat(Block)
    elif a.variant == "dots":
        block = nn.remat(Block, policy=jax.checkpoint_policies.dots_saveable)

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            init = nn.initializers.normal(stddev=1.0 / d**0.5)
            x = nn.Embed(vocab, d, embedding_init=init, dtype=compute)(tokens)
            x = x + nn.Embed(a.seq, d, embedding_init=init, dtype=compute)(jnp.arange(tokens.shape[1]))
            for _ in range(a.layers):
                x = block()(x)
            x = nn.LayerNorm(epsilon=1e-6, dtype=compute)(x)
            return nn.Dense(vocab, use_bias=False, dtype=compute)(x)

    model = GPT()
    tx = optax.adam(3e-4, b1=0.9, b2=0.999, eps=1e-8)

    def batch(seed):
        tokens = jax.random.randint(jax.random.key(seed), (a.batch, a.seq + 1), 0, vocab)
        return tokens[:, :-1], tokens[:, 1:]

    params = model.init(jax.random.key(0), batch(0)[0])["params"]
    state = tx.init(params)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

    @jax.jit
    def step(params, state, inputs, labels):
        def loss(p):
            logits = model.apply({"params": p}, inputs).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    inputs, labels = batch(1000)
    t0 = time.perf_counter()
    params, state, value = jax.block_until_ready(step(params, state, inputs, labels))
    compile_s = time.perf_counter() - t0
    losses = [float(value)]
    times = []
    for i in range(a.steps):
        inputs, labels = batch(1001 + i)
        t0 = time.perf_counter()
        params, state, value = jax.block_until_ready(step(params, state, inputs, labels))
        times.append(time.perf_counter() - t0)
        losses.append(float(value))
        print(f"{a.variant} {a.dtype} step {i}: loss {losses[-1]:.4f}  {times[-1]:.3f} s", file=sys.stderr, flush=True)
    temp = step.lower(params, state, inputs, labels).compile().memory_analysis().temp_size_in_bytes
    print(json.dumps({"peer": f"jax-{jax.__version__}+flax-{flax.__version__}", "variant": a.variant, "dtype": a.dtype,
                      "layers": a.layers, "batch": a.batch, "seq": a.seq, "params": int(n_params), "steps": a.steps,
                      "compile_s": round(compile_s, 3), "step_s_min": round(min(times), 4),
                      "step_s_median": round(statistics.median(times), 4), "loss_first": round(losses[0], 4),
                      "loss_last": round(losses[-1], 4), "xla_temp_bytes": int(temp)}), flush=True)


if __name__ == "__main__":
    main()
