"""Peer for `linum-bench rnn`: an LSTM (input 64, hidden 256, batch 32) over T steps, loss mean(h_t^2)
over all outputs, jax.jit(jax.value_and_grad) of it, as Flax users write it (pip: jax, flax).
Prints one JSON line per (length, variant); compile_s is the first call (tracing and XLA
compilation), step_s_min the steady state, xla_temp_bytes the compiled step's temporary buffers
(XLA's memory analysis: activations and workspace).

Variants:
  lstm            nn.RNN(nn.LSTMCell(256))
  optimized       nn.RNN(nn.OptimizedLSTMCell(256))
  optimized_remat nn.RNN(nn.remat(nn.OptimizedLSTMCell)(256)): remat per time step
  gru             nn.RNN(nn.GRUCell(256))
  gru_remat       nn.RNN(nn.remat(nn.GRUCell)(256)): remat per time step

  python3 tests/bench/flax_lstm.py [--lengths 64,256,1024] [--variants ...] [--dtype f32|bf16] [--masked]
--dtype bf16: the cells compute in bf16 (dtype=jnp.bfloat16, float32 parameters). --masked: nn.RNN
with seq_lengths and return_carry (rows' lengths spread over [T/2, T], the final carry's h added to
the loss, as linum-bench rnn --masked 1).
Threads: XLA's CPU backend uses every core it sees (2 on the project's machines).
"""
import argparse, json, time
import jax
import jax.numpy as jnp
import flax
import flax.linen as nn

p = argparse.ArgumentParser()
p.add_argument("--lengths", default="64,256,1024")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--features", type=int, default=256)
p.add_argument("--inputs", type=int, default=64)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--variants", default="lstm,optimized,optimized_remat")
p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
p.add_argument("--masked", action="store_true")
a = p.parse_args()
B, H, I = a.batch, a.features, a.inputs

dt = jnp.bfloat16 if a.dtype == "bf16" else None
cells = {"lstm": lambda: nn.LSTMCell(H, dtype=dt), "optimized": lambda: nn.OptimizedLSTMCell(H, dtype=dt),
         "optimized_remat": lambda: nn.remat(nn.OptimizedLSTMCell)(H, dtype=dt), "gru": lambda: nn.GRUCell(H, dtype=dt),
         "gru_remat": lambda: nn.remat(nn.GRUCell)(H, dtype=dt)}

for T in [int(t) for t in a.lengths.split(",")]:
    xs = jax.random.normal(jax.random.key(1), (B, T, I))
    lengths = jnp.array([T - (T // 2) * b // max(1, B - 1) for b in range(B)], jnp.int32) if a.masked else None
    for v in a.variants.split(","):
        model = nn.RNN(cells[v]())
        params = model.init(jax.random.key(0), xs)

        @jax.jit
        def step(params, xs):
            def loss(p):
                if lengths is None:
                    return jnp.mean(jnp.square(model.apply(p, xs).astype(jnp.float32)))
                # Masked: the final carry (each row's at its length) joins the loss, as a user's would.
                carry, ys = model.apply(p, xs, seq_lengths=lengths, return_carry=True)
                h = jax.tree_util.tree_leaves(carry)[-1]
                return jnp.mean(jnp.square(ys.astype(jnp.float32))) + jnp.mean(h.astype(jnp.float32))
            return jax.value_and_grad(loss)(params)

        t0 = time.perf_counter()
        jax.block_until_ready(step(params, xs))
        first = time.perf_counter() - t0
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, xs))
            times.append(time.perf_counter() - t0)
        # XLA's buffer assignment for the compiled step: its temporaries (activations and workspace).
        temp = step.lower(params, xs).compile().memory_analysis().temp_size_in_bytes
        print(json.dumps({"peer": f"jax-{jax.__version__}+flax-{flax.__version__}", "bench": "rnn", "model": "gru" if v.startswith("gru") else "lstm", "variant": v,
                          "length": T, "batch": B, "features": H, "inputs": I, "dtype": a.dtype,
                          **({"masked": True} if a.masked else {}), "compile_s": first,
                          "step_s_min": min(times), "xla_temp_bytes": temp}), flush=True)
