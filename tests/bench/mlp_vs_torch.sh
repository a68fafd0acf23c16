#!/usr/bin/env bash
# The deep-MLP step, Linum next to PyTorch 1.13 (Debian's python3-torch), in one sitting: each Linum
# variant and dtype is followed by PyTorch's counterpart, so both see the same machine state. Every
# line is JSON. PyTorch runs as its users run it: no allocator knobs, its own threading (2 threads).
#
#   bash tests/bench/mlp_vs_torch.sh [BUILD_DIR]        (default build/)
# Needs /usr/bin/python3 with torch (apt-get install python3-torch; libopenblas0-openmp gives
# PyTorch's float32 products a real BLAS, else Debian's reference BLAS makes them ~30x slower).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
bench="$build/tests/bench/linum-bench"
steps="${STEPS:-5}"
for dtype in f32 bf16; do
  torch_dtype=$([ "$dtype" = f32 ] && echo fp32 || echo bf16)
  for pair in plain:none remat_every:every remat_sqrt:sqrt remat_dots:; do
    variant="${pair%%:*}" mode="${pair#*:}"
    "$bench" mlp --dtype "$dtype" --variant "$variant" --steps "$steps"
    if [ -n "$mode" ]; then STEPS="$steps" /usr/bin/python3 "$here/torch_mlp.py" "$mode" "$torch_dtype"; fi
  done
done
