"""The same CNN as examples/fashion_mnist in Debian's PyTorch (python3-torch), for comparing
accuracy and epoch time on the same machine.

Usage: python3 torch_cnn.py [--epochs 3] [--batch 128] [--lr 0.001] [--threads 2] [--data DIR]
                           [--dtype f32|bf16]
--dtype bf16 trains under torch.autocast("cpu", dtype=torch.bfloat16) (float32 parameters, bf16
convolutions and matrix products), PyTorch's mixed precision, the peer of the example's --dtype bf16.
Prints progress lines and, last, one JSON object: {"peer", "dtype", "test_accuracy", "epochs",
"seconds_per_epoch"}.
"""
import argparse, gzip, json, struct, time

import numpy as np
import torch

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batch", type=int, default=128)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
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


xtr, ytr = load("train")
xte, yte = load("t10k")
# Conv 32 3x3 SAME, ReLU, avg pool; Conv 64 3x3 SAME, ReLU, avg pool; Dense 256, ReLU; Dense 10.
model = torch.nn.Sequential(
    torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
seconds = []
for epoch in range(a.epochs):
    order = torch.randperm(len(ytr))
    start = time.perf_counter()
    model.train()
    for b in range(0, len(ytr) - a.batch + 1, a.batch):
        idx = order[b:b + a.batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(xtr[idx])
        loss = torch.nn.functional.cross_entropy(logits.float(), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds.append(time.perf_counter() - start)
    print(f"epoch {epoch + 1}/{a.epochs} {seconds[-1]:.1f} s, last loss {loss.item():.4f}", flush=True)
model.eval()
with torch.no_grad():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        hits = sum((model(xte[i:i + 500]).argmax(1) == yte[i:i + 500]).sum().item() for i in range(0, len(yte), 500))
print(json.dumps({"peer": "torch-" + torch.__version__, "dtype": a.dtype, "test_accuracy": hits / len(yte), "epochs": a.epochs,
                  "seconds_per_epoch": sum(seconds) / len(seconds)}))
