"""Peer for `linum-bench rnn`: an LSTM (or with --model gru a GRU; input 64, hidden 256, batch 32) over T
steps, loss mean(h_t^2) over all outputs, forward + backward, as PyTorch users write it. Runs in PyTorch 2.x (pip's torch)
and in Debian's 1.13 (/usr/bin/python3). Prints one JSON line per (length, variant).

Variants:
  nn_lstm        torch.nn.LSTM (batch_first, as Linum's [batch, time, features]): oneDNN's or ATen's
                 fused LSTM kernel (--model gru: torch.nn.GRU; the variants keep their names)
  nn_lstm_compile  the same module under torch.compile (default mode; PyTorch 2 only): compile time
                 reported separately (compile_s: the first step's time)
  cell_loop      torch.nn.LSTMCell in a Python loop
  cell_ckpt      the same loop with torch.utils.checkpoint around every step (remat per time step)

  python3 tests/bench/torch_lstm.py [--lengths 64,256,1024] [--variants ...] [--threads 2] [--model lstm|gru]
                                   [--dtype f32|bf16]
--dtype bf16: the step under torch.autocast("cpu", dtype=torch.bfloat16), as PyTorch users train in
bf16 (float32 parameters; nn.LSTM/nn.GRU run on oneDNN's bf16 RNN kernels in PyTorch 2).
"""
import argparse, json, time
import torch
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--lengths", default="64,256,1024")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--features", type=int, default=256)
p.add_argument("--inputs", type=int, default=64)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--variants", default="nn_lstm,nn_lstm_compile,cell_loop,cell_ckpt")
p.add_argument("--model", default="lstm", choices=["lstm", "gru"])
p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
p.add_argument("--memory", action="store_true",
               help="one extra untimed step under the profiler: peak of live tensor bytes (PyTorch 2)")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
B, H, I = a.batch, a.features, a.inputs
gru = a.model == "gru"
lstm = (torch.nn.GRU if gru else torch.nn.LSTM)(I, H, batch_first=True)
cell = (torch.nn.GRUCell if gru else torch.nn.LSTMCell)(I, H)
compiled = None


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16")


def step_module(module, xs):
    with autocast():
        out, _ = module(xs)
        loss = (out.float() * out.float()).mean()
    loss.backward()


def step_cells(xs, ckpt):
    h = torch.zeros(B, H)
    c = torch.zeros(B, H)
    outs = []
    for t in range(xs.shape[1]):
        state = h if gru else (h, c)
        with autocast():
            if ckpt:
                state = checkpoint(cell, xs[:, t], state, use_reentrant=False)
            else:
                state = cell(xs[:, t], state)
        h, c = (state, None) if gru else state
        outs.append(h)
    out = torch.stack(outs, 1).float()
    loss = (out * out).mean()
    loss.backward()


def peak_bytes(f, module):
    """Peak of live tensor bytes during one step, from the profiler's allocation events, minus the
    parameters' gradients (as linum-bench rnn's peak excludes the gradients)."""
    from torch.profiler import ProfilerActivity, profile
    for prm in module.parameters():
        prm.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        f()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns() if hasattr(e, "start_ns") else e.start_us())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak - sum(prm.numel() * prm.element_size() for prm in module.parameters())


variants = a.variants.split(",")
if not hasattr(torch, "compile"):
    variants = [v for v in variants if v != "nn_lstm_compile"]
for T in [int(t) for t in a.lengths.split(",")]:
    xs = torch.randn(B, T, I)
    for v in variants:
        if v == "nn_lstm_compile" and compiled is None:
            compiled = torch.compile(lstm)
        f = {"nn_lstm": lambda: step_module(lstm, xs), "nn_lstm_compile": lambda: step_module(compiled, xs),
             "cell_loop": lambda: step_cells(xs, False), "cell_ckpt": lambda: step_cells(xs, True)}[v]
        t0 = time.perf_counter()
        f()  # warm-up (and compilation)
        first = time.perf_counter() - t0
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        out = {"peer": "torch-" + torch.__version__, "bench": "rnn", "model": a.model, "variant": v, "length": T, "batch": B,
               "features": H, "inputs": I, "dtype": a.dtype, "step_s_min": min(times)}
        if v == "nn_lstm_compile":
            out["compile_s"] = first
        if a.memory and v != "nn_lstm_compile":
            out["peak_activation_bytes"] = peak_bytes(f, lstm if v == "nn_lstm" else cell)
        print(json.dumps(out), flush=True)
