"""Peer for `linum-bench mlp`: one training step (forward + backward) of L x Dense(W) + GELU on a
batch of B, loss mean(h*h), as Flax users write it: jax.jit(jax.value_and_grad(loss)) (pip: jax,
flax). Prints one JSON line.

Usage: python3 flax_mlp.py MODE [DTYPE]
  MODE   none   no checkpointing
         every  nn.remat around every layer (jax.checkpoint, nothing saved)
         dots   nn.remat with policy=jax.checkpoint_policies.dots_saveable
         sqrt   as PyTorch's checkpoint_sequential with sqrt(L) segments: nn.remat around each of the
                first sqrt(L) - 1 segments of L // sqrt(L) layers, the rest plain
  DTYPE  fp32 (default) or bf16: Dense(dtype=bfloat16) with float32 parameters (Flax's mixed
         precision, like Linum's --dtype bf16)
Environment: L, W, B, STEPS (defaults 24, 512, 2048, 5). XLA's CPU backend uses every core it sees.
compile_s is the first call (tracing and XLA compilation), step_s_min the steady state,
xla_temp_bytes the compiled step's temporary buffers (XLA's memory analysis), products_lowered and
products_compiled the matrix products in the program JAX lowers and in the one XLA compiled from it
(with remat the lowered program recomputes products; on CPU the compiled one may not)."""
import json, math, os, re, sys, time
import jax
import jax.numpy as jnp
import flax
import flax.linen as nn

L, W, B = (int(os.environ.get(k, d)) for k, d in (("L", 24), ("W", 512), ("B", 2048)))
STEPS = int(os.environ.get("STEPS", 5))
mode = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "fp32"
assert mode in ("none", "every", "dots", "sqrt"), mode
assert dtype in ("fp32", "bf16"), dtype
compute = jnp.bfloat16 if dtype == "bf16" else jnp.float32


class Layer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.gelu(nn.Dense(W, dtype=compute)(h))


class Segment(nn.Module):
    count: int
    @nn.compact
    def __call__(self, h):
        for _ in range(self.count):
            h = Layer()(h)
        return h
class MLP(nn.Module):
    @nn.compact
    def __call__(self, h):
        if mode == "sqrt":  # as checkpoint_sequential: segments - 1 rematted, the rest plain
            segments = max(1, int(math.sqrt(L)))
            per = L // segments
            for _ in range(segments - 1):
                h = nn.remat(Segment)(per)(h)
            return Segment(L - per * (segments - 1))(h)
        block = Layer
        if mode == "every":
            block = nn.remat(Layer)
        elif mode == "dots":
            block = nn.remat(Layer, policy=jax.checkpoint_policies.dots_saveable)
        for _ in range(L):
            h = block()(h)
        return h


model = MLP()
x = jax.random.normal(jax.random.key(1), (B, W))
params = model.init(jax.random.key(0), x)


@jax.jit
def step(params, x):
    def loss(p):
        h = model.apply(p, x).astype(jnp.float32)
        return jnp.mean(h * h)
    return jax.value_and_grad(loss)(params)


t0 = time.perf_counter()
jax.block_until_ready(step(params, x))
first = time.perf_counter() - t0
times = []
for _ in range(STEPS):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x))
    times.append(time.perf_counter() - t0)
lowered = step.lower(params, x)
compiled = lowered.compile()
temp = compiled.memory_analysis().temp_size_in_bytes
# The matrix products JAX asks for (with remat, the recomputed ones too) and those XLA's compiled
# program runs: on CPU, XLA drops the optimization barriers of nn.remat and the products they guard.
products_lowered = len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))
products_compiled = len(re.findall(r"\bdot\(", compiled.as_text()))
flops = 3 * 2 * B * W * W * L
print(json.dumps({"peer": f"jax-{jax.__version__}+flax-{flax.__version__}", "mode": mode, "dtype": dtype, "L": L, "W": W,
                  "B": B, "compile_s": first, "step_s_min": min(times), "step_s_median": sorted(times)[len(times) // 2],
                  "model_gflops": flops / min(times) / 1e9, "xla_temp_bytes": temp,
                  "products_lowered": products_lowered, "products_compiled": products_compiled}), flush=True)
