"""Peer baseline (copied from the project's shared bench folder; run by tests/bench/mlp_vs_torch.sh) for the deep-MLP benchmark: one training step (forward + backward) of
L x Dense(W) + GELU on a batch of B, in Debian's PyTorch (python3-torch, CPU).

Usage: /usr/bin/python3 torch_mlp.py MODE [DTYPE]
  MODE   none   no checkpointing
         every  torch.utils.checkpoint around every layer (non-reentrant)
         sqrt   checkpoint_sequential with sqrt(L) segments (the last one runs plain;
                use_reentrant=False where PyTorch takes it)
  DTYPE  fp32 (default) or bf16: torch.autocast("cpu", dtype=torch.bfloat16) around the forward,
         parameters stay float32 (PyTorch's mixed precision; on CPUs with AMX or AVX512-BF16 its
         matrix products run through oneDNN's bf16 kernels).
Environment: L, W, B, STEPS, THREADS (defaults 24, 512, 2048, 5, 2); COMPILE=1 runs the model under
torch.compile (default mode; PyTorch 2 only), the first step's time reported as compile_s.
Prints one JSON line. Run it with Debian's interpreter (/usr/bin/python3), where python3-torch is.

Memory: peak_rss_growth_mib is the growth of the process's peak RSS over its RSS before the first
step. Do not set MALLOC_MMAP_THRESHOLD_ or other allocator knobs to sharpen that figure: they slow
PyTorch's step by 20-30% and make any time comparison unfair. For a whole-process figure, run the
script under `/usr/bin/time -v` and subtract the RSS of `import torch` alone."""
import inspect, json, math, os, sys, time
import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

L, W, B = (int(os.environ.get(k, d)) for k, d in (("L", 24), ("W", 512), ("B", 2048)))
STEPS = int(os.environ.get("STEPS", 5))
torch.set_num_threads(int(os.environ.get("THREADS", 2)))
torch.manual_seed(0)
mode = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "fp32"
assert mode in ("none", "every", "sqrt"), mode
assert dtype in ("fp32", "bf16"), dtype

layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.GELU()) for _ in range(L)])
# PyTorch 2 warns unless use_reentrant is passed and recommends False (1.13 takes no such argument
# and is reentrant).
sequential_kwargs = ({"use_reentrant": False}
                     if "use_reentrant" in inspect.signature(checkpoint_sequential).parameters else {})
# The reentrant checkpoint_sequential (1.13) needs an input that requires grad to reach the
# parameters, which costs it one more product per step (x's gradient); the non-reentrant one does not.
x = torch.randn(B, W).requires_grad_(mode == "sqrt" and not sequential_kwargs)
compiled = os.environ.get("COMPILE", "0") == "1"
model = torch.compile(layers) if compiled else layers


def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dtype == "bf16")):
        if mode == "none":
            h = model(x)
        elif mode == "every":
            h = x
            for block in layers:
                h = checkpoint(block, h, use_reentrant=False)
        else:
            h = checkpoint_sequential(layers, int(math.sqrt(L)), x, **sequential_kwargs)
    h = h.float()
    (h * h).mean().backward()
    layers.zero_grad(set_to_none=True)


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


base = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark
t0 = time.perf_counter()
step()  # warm-up (and compilation)
first = time.perf_counter() - t0
times = []
for _ in range(STEPS):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
flops = 3 * 2 * B * W * W * L
print(json.dumps({"peer": "torch-" + torch.__version__ + ("+compile" if compiled else ""), "mode": mode, "dtype": dtype,
                  "L": L, "W": W, "B": B, "compile_s": first if compiled else None,
                  "threads": torch.get_num_threads(),
                  "step_s_min": min(times), "step_s_median": sorted(times)[len(times) // 2],
                  "model_gflops": flops / min(times) / 1e9,
                  "peak_rss_growth_mib": (status_kib("VmHWM") - base) / 1024}))
