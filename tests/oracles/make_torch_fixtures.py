#!/usr/bin/env python3
"""Writes tests/oracles/fixtures/torch_layers.safetensors: PyTorch layers' state dicts with an input
and PyTorch's output for each, and a small model (conv + LSTM + attention) saved with
safetensors.torch.save_file, for tests/test_torch_layouts.cpp (torch_layouts::* maps each into the
equivalent Linum layer, which must give PyTorch's outputs).

    pip install torch==2.13.0 safetensors==0.8.0
    python3 tests/oracles/make_torch_fixtures.py

Names: "<case>.<PyTorch parameter name>" for the weights, "<case>.__x" (and "__x2") for inputs and
"<case>.__y" for the output, images in Linum's NHWC layout (PyTorch computes in NCHW; the script
permutes). Deterministic: torch.manual_seed per case, CPU, float32.
"""
import os
import sys

import safetensors
import torch
from safetensors.torch import save_file

PINNED = {"torch": "2.13.0", "safetensors": "0.8.0"}
HERE = os.path.dirname(os.path.abspath(__file__))
nn = torch.nn


def nhwc(t):
    return t.permute(0, 2, 3, 1).contiguous()


class Model(nn.Module):
    """Conv + BatchNorm + ReLU over a [B, 1, 6, 8] image, its columns as a sequence of 8 steps into an
    LSTM, self-attention with a residual, LayerNorm, mean over time, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lstm = nn.LSTM(24, 16, batch_first=True)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))               # [B, 4, 6, 8]
        b, c, hh, w = h.shape
        seq = h.permute(0, 3, 1, 2).reshape(b, w, c * hh)   # [B, 8, 24]: column t, channel-major
        y, _ = self.lstm(seq)
        a, _ = self.attn(y, y, y, need_weights=False)
        z = self.norm(y + a)
        return self.head(z.mean(dim=1))


def main():
    found = {"torch": torch.__version__.split("+")[0], "safetensors": safetensors.__version__}
    if found != PINNED and "--any-version" not in sys.argv:
        sys.exit(f"pinned {PINNED}, found {found}")
    torch.set_num_threads(1)
    out = {}

    def case(name, module, x, forward=None, x_to_linum=lambda t: t, y_to_linum=lambda t: t, x2=None):
        module.eval()
        with torch.no_grad():
            y = forward(module, x) if forward else module(x)
        for k, v in module.state_dict().items():
            if v.dtype.is_floating_point:
                out[f"{name}.{k}"] = v.detach().contiguous()
        out[f"{name}.__x"] = x_to_linum(x).contiguous()
        out[f"{name}.__y"] = y_to_linum(y).contiguous()

    torch.manual_seed(1)
    case("linear", nn.Linear(4, 3), torch.randn(2, 4))
    torch.manual_seed(2)
    case("conv2d", nn.Conv2d(3, 6, 3, stride=2, padding=1, groups=3), torch.randn(2, 3, 7, 6),
         x_to_linum=nhwc, y_to_linum=nhwc)
    torch.manual_seed(3)
    case("conv2d_dilated", nn.Conv2d(3, 4, (3, 2), padding=(2, 1), dilation=(2, 1), bias=False),
         torch.randn(2, 3, 7, 6), x_to_linum=nhwc, y_to_linum=nhwc)
    torch.manual_seed(4)
    case("conv_transpose2d", nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
         torch.randn(2, 3, 5, 4), x_to_linum=nhwc, y_to_linum=nhwc)
    torch.manual_seed(5)
    case("layer_norm", nn.LayerNorm(6), torch.randn(2, 5, 6))
    torch.manual_seed(6)
    case("group_norm", nn.GroupNorm(3, 6), torch.randn(2, 6, 4, 4), x_to_linum=nhwc, y_to_linum=nhwc)
    torch.manual_seed(7)
    bn = nn.BatchNorm2d(6)
    bn.train()
    with torch.no_grad():
        for _ in range(3):  # running statistics away from 0 and 1
            bn(torch.randn(4, 6, 3, 3) * 2 + 1)
        bn.weight.copy_(torch.randn(6))
        bn.bias.copy_(torch.randn(6))
    case("batch_norm", bn, torch.randn(2, 6, 4, 4), x_to_linum=nhwc, y_to_linum=nhwc)
    torch.manual_seed(8)
    emb = nn.Embedding(10, 4)
    ids = torch.tensor([[1, 5, 9], [0, 3, 3]])
    with torch.no_grad():
        out["embedding.weight"] = emb.weight.detach().contiguous()
        out["embedding.__x"] = ids.to(torch.int32)
        out["embedding.__y"] = emb(ids).contiguous()
    torch.manual_seed(9)
    case("lstm", nn.LSTM(4, 5, batch_first=True), torch.randn(2, 6, 4), forward=lambda m, x: m(x)[0])
    torch.manual_seed(10)
    case("gru", nn.GRU(4, 5, batch_first=True), torch.randn(2, 6, 4), forward=lambda m, x: m(x)[0])
    torch.manual_seed(11)
    case("mha", nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 5, 8),
         forward=lambda m, x: m(x, x, x, need_weights=False)[0])
    torch.manual_seed(12)
    model = Model()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 1, 6, 8))  # BatchNorm running statistics
    case("model", model, torch.randn(3, 1, 6, 8), x_to_linum=nhwc)
    path = os.path.join(HERE, "fixtures", "torch_layers.safetensors")
    save_file(out, path, metadata={"written_by": f"torch {found['torch']}, safetensors {found['safetensors']}"})
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
