"""The main example's model (examples/fashion_mnist/model.hpp: ResNet) in PyTorch, for comparing
accuracy and epoch time on the same machine.

Usage: python3 torch_cnn.py [--epochs 3] [--batch 128] [--lr 0.001] [--depth 8] [--width 24]
                           [--threads 2] [--data DIR] [--dtype f32|bf16] [--remat full|none] [--limit N]
                           [--compile]
--dtype bf16 trains under torch.autocast("cpu", dtype=torch.bfloat16) (float32 parameters, bf16
convolutions and matrix products), PyTorch's mixed precision, the peer of the example's --dtype bf16.
--remat full checkpoints the stem and every residual block but the last with
torch.utils.checkpoint (use_reentrant=False), as the example's default. The learning rate halves
every epoch, smoothly per step, as the example's schedule. BatchNorm momentum 0.1 is Flax's 0.9.
--limit N trains on the first N training images (a quick check).
--compile trains the model under torch.compile (default mode; PyTorch 2 only). Its first step
traces and compiles (and evaluation compiles again, for BatchNorm's inference mode): "compile_s" is
the first step's time less a steady step's (the epoch's median step), and "seconds_per_epoch"
counts the first step as a median one, so it is the steady state's epoch.
Before training it measures the activation memory of one forward and backward pass over a batch
(a copy of the model; the peer of the example's peak_activation_bytes with --micro-batches 1): the
peak of live tensor bytes from the profiler's allocation events (tensors of PyTorch's CPU
allocator; oneDNN's own scratch buffers are not among them, nor are Linum's), less the parameters'
gradients, with --remat and without.
Prints progress lines and, last, one JSON object: {"peer", "dtype", "remat", "test_accuracy",
"epochs", "seconds_per_epoch", "peak_activation_bytes", "peak_activation_bytes_plain"}.
"""
import argparse, copy, gzip, json, struct, time

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batch", type=int, default=128)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--depth", type=int, default=8)
p.add_argument("--width", type=int, default=24)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
p.add_argument("--remat", choices=["full", "none"], default="full")
p.add_argument("--limit", type=int, default=0)
p.add_argument("--compile", action="store_true")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(a.seed)


def load(prefix):
    with gzip.open(f"{a.data}/{prefix}-images-idx3-ubyte.gz") as f:
        _, n, r, c = struct.unpack(">IIII", f.read(16))
        x = np.frombuffer(f.read(), np.uint8).reshape(n, 1, r, c).astype(np.float32) / 255.0
    with gzip.open(f"{a.data}/{prefix}-labels-idx1-ubyte.gz") as f:
        f.read(8)
        y = np.frombuffer(f.read(), np.uint8).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def bn(c):
    return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)


class ResidualBlock(nn.Module):
    """conv -> BN -> ReLU -> conv -> BN, plus the input, then ReLU (Flax's ResNet block)."""

    def __init__(self, c):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(c, c, 3, padding=1, bias=False), bn(c)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), bn(c)

    def forward(self, x):
        y = torch.relu(self.bn0(self.conv0(x)))
        return torch.relu(x + self.bn1(self.conv1(y)))


class ResNet(nn.Module):
    def __init__(self, depth, width):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), bn(width), nn.ReLU(), nn.AvgPool2d(2))
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(width * 7 * 7, 256), nn.ReLU(),
                                  nn.Linear(256, 10))

    def forward(self, x):
        remat = a.remat == "full" and self.training and torch.is_grad_enabled()
        run = (lambda m, v: checkpoint(m, v, use_reentrant=False)) if remat else (lambda m, v: m(v))
        x = run(self.stem, x)
        for k, block in enumerate(self.blocks):
            x = block(x) if k + 1 == len(self.blocks) else run(block, x)
        return self.head(x)


def peak_activation_bytes(model, x, y, remat):
    """Peak of live tensor bytes during one forward and backward pass (remat "full" or "none") from
    the profiler's allocation events, less the parameters' gradients (the pass returns those)."""
    from torch.profiler import ProfilerActivity, profile
    saved, a.remat = a.remat, remat
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.float(), y).backward()
    a.remat = saved
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns() if hasattr(e, "start_ns") else e.start_us())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak - sum(prm.numel() * prm.element_size() for prm in model.parameters())


xtr, ytr = load("train")
xte, yte = load("t10k")
if a.limit:
    xtr, ytr = xtr[: a.limit], ytr[: a.limit]
model = ResNet(a.depth, a.width)
probe = copy.deepcopy(model).train()  # the measurement's forward pass updates BatchNorm's statistics
memory = {"peak_activation_bytes": peak_activation_bytes(probe, xtr[:a.batch], ytr[:a.batch], a.remat),
          "peak_activation_bytes_plain": peak_activation_bytes(probe, xtr[:a.batch], ytr[:a.batch], "none")}
del probe
run_model = torch.compile(model) if a.compile else model
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
steps_per_epoch = len(ytr) // a.batch
sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5 ** (1.0 / steps_per_epoch))
seconds, compile_s = [], None
for epoch in range(a.epochs):
    order = torch.randperm(len(ytr))
    model.train()
    steps = []
    for b in range(0, len(ytr) - a.batch + 1, a.batch):
        idx = order[b:b + a.batch]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = run_model(xtr[idx])
        loss = torch.nn.functional.cross_entropy(logits.float(), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        steps.append(time.perf_counter() - t0)
    if a.compile and epoch == 0:
        median = sorted(steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else 0.0
        compile_s, steps[0] = steps[0] - median, median
    seconds.append(sum(steps))
    print(f"epoch {epoch + 1}/{a.epochs} {seconds[-1]:.1f} s, last loss {loss.item():.4f}", flush=True)
model.eval()
with torch.no_grad():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        hits = sum((run_model(xte[i:i + 500]).argmax(1) == yte[i:i + 500]).sum().item() for i in range(0, len(yte), 500))
print(json.dumps({"peer": "torch-" + torch.__version__, "dtype": a.dtype, "remat": a.remat, "test_accuracy": hits / len(yte),
                  "epochs": a.epochs, "seconds_per_epoch": sum(seconds) / len(seconds), **memory,
                  **({"compiled": True, "compile_s": compile_s} if a.compile else {})}))
