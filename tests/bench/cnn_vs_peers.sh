#!/usr/bin/env bash
# The main example's ResNet (examples/fashion_mnist: one epoch of Fashion-MNIST, batch 128, adam,
# remat of the stem and every block but the last, the default; Linum with --micro-batches 1, so its
# BatchNorm sees the whole batch of 128 as the peers' do), Linum next to its peers in one
# sitting, alternating per dtype: PyTorch 2 from pip (eager, torch.utils.checkpoint;
# examples/fashion_mnist/torch_cnn.py; and the same under torch.compile, default mode, its first
# step's tracing and compilation reported apart as compile_s), Flax on JAX jit (nn.remat; flax_cnn.py, its tracing and
# compilation reported apart), and Debian's PyTorch 1.13 when /usr/bin/python3 has torch. bf16 is
# each one's mixed precision (Linum's --dtype bf16 and Flax's dtype=bf16 with float32 parameters,
# PyTorch's autocast). Prints each run's closing JSON line, tagged with "framework".
#
#   bash tests/bench/cnn_vs_peers.sh [BUILD_DIR]        (ROUNDS=1 EPOCHS=1 DTYPES="f32 bf16")
#
# DTYPES=f32 leaves bf16 out: on CPUs without bf16 instructions (AVX2 only, e.g. AMD Zen 3) the
# peers' bf16 takes slow fallback paths (PyTorch 2.13's autocast MLP step: 22 s against 0.48 in
# float32), and a bf16 sitting would take hours.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
example="$build/examples/fashion_mnist"
cnn="$here/../../examples/fashion_mnist"
epochs="${EPOCHS:-1}"
rounds="${ROUNDS:-1}"
tag() { python3 -c 'import json,sys; j=json.loads(sys.stdin.read().strip().splitlines()[-1]); j["framework"]=sys.argv[1]; print(json.dumps(j))' "$1"; }
for round in $(seq "$rounds"); do
  for dtype in ${DTYPES:-f32 bf16}; do
    "$example" --epochs "$epochs" --dtype "$dtype" --micro-batches 1 | tag linum
    python3 "$cnn/torch_cnn.py" --epochs "$epochs" --dtype "$dtype" 2>/dev/null | tag "torch $(python3 -c 'import torch; print(torch.__version__)')"
    python3 "$cnn/torch_cnn.py" --epochs "$epochs" --dtype "$dtype" --compile 2>/dev/null | tag "torch $(python3 -c 'import torch; print(torch.__version__)') compile"
    if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
      /usr/bin/python3 "$cnn/torch_cnn.py" --epochs "$epochs" --dtype "$dtype" 2>/dev/null | tag "torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)')"
    fi
    python3 "$cnn/flax_cnn.py" --epochs "$epochs" --dtype "$dtype" 2>/dev/null | tag "flax $(python3 -c 'import flax; print(flax.__version__)')"
  done
done
