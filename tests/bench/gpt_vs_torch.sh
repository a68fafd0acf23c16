#!/usr/bin/env bash
# The GPT-style training step (linum-bench gpt), Linum next to PyTorch 1.13 (Debian's python3-torch,
# tests/bench/torch_gpt.py) in one sitting: each Linum variant is followed by its PyTorch
# counterpart, so both see the same machine state. Every line is JSON. PyTorch runs as its users run
# it: no allocator knobs, 2 threads, its peak activation bytes from its profiler (--memory).
#
#   bash tests/bench/gpt_vs_torch.sh [BUILD_DIR]        (default build/; STEPS=5)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
bench="$build/tests/bench/linum-bench"
steps="${STEPS:-5}"
for dtype in f32 bf16; do
  for pair in plain:plain remat:ckpt dots: scan_remat:; do
    variant="${pair%%:*}" torch_variant="${pair#*:}"
    "$bench" gpt --dtype "$dtype" --variant "$variant" --steps "$steps"
    if [ -n "$torch_variant" ]; then
      [ "$dtype" = bf16 ] && torch_variant=$([ "$torch_variant" = plain ] && echo bf16 || echo bf16_ckpt)
      /usr/bin/python3 "$here/torch_gpt.py" --variant "$torch_variant" --steps "$steps" --memory 2>/dev/null
    fi
  done
done
