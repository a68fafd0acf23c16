#!/usr/bin/env bash
# The plain (no remat) steps of the deep MLP (f32 and bf16) and of the GPT (bf16), Linum next to
# PyTorch 2 eager and torch.compile, Debian's PyTorch 1.13 (MLP) and Flax on JAX jit, alternating,
# ROUNDS rounds (default 2). A quick sitting for the issue's plain-step comparisons; the full
# sittings are mlp_vs_peers.sh and gpt_vs_peers.sh. Every line is JSON; the first says when and at
# which commit.
#
#   bash tests/bench/plain_vs_peers.sh [BUILD_DIR]
set -u
here="$(cd "$(dirname "$0")" && pwd)"
B="${1:-build}/tests/bench/linum-bench"
echo "{\"sitting\":\"$(date -u +%FT%TZ)\",\"commit\":\"$(git -C "$here" rev-parse --short HEAD)\",\"command\":\"bash tests/bench/plain_vs_peers.sh\"}"
for round in $(seq "${ROUNDS:-2}"); do
  for dtype in f32 bf16; do
    pd=$([ $dtype = f32 ] && echo fp32 || echo bf16)
    "$B" mlp --dtype $dtype --variant plain --steps 8
    STEPS=8 python3 "$here/torch_mlp.py" none $pd
    COMPILE=1 STEPS=8 python3 "$here/torch_mlp.py" none $pd 2>/dev/null
    if /usr/bin/python3 -c 'import torch' 2>/dev/null; then STEPS=8 /usr/bin/python3 "$here/torch_mlp.py" none $pd 2>/dev/null; fi
    STEPS=8 python3 "$here/flax_mlp.py" none $pd 2>/dev/null
  done
  "$B" gpt --dtype bf16 --variant plain --steps 5
  python3 "$here/torch_gpt.py" --variant bf16 --steps 5 --compile 2>/dev/null
  python3 "$here/torch_gpt.py" --variant bf16 --steps 5 2>/dev/null
  python3 "$here/flax_gpt.py" --variant plain --dtype bf16 --steps 5 2>/dev/null
done
