#!/usr/bin/env bash
# The GPT-style training step (linum-bench gpt: 8 pre-LayerNorm blocks of width 256, 4 heads,
# sequence 256, batch 16, adam), Linum next to today's peers in one sitting, alternating per
# variant and dtype: PyTorch 2 from pip (eager, and torch.compile for the plain step;
# tests/bench/torch_gpt.py), Flax on JAX jit (tests/bench/flax_gpt.py: nn.remat per block, and the
# dots_saveable policy), and Debian's PyTorch 1.13 when /usr/bin/python3 has torch. Peers run as
# their users run them: default settings, 2 threads for PyTorch, XLA's defaults for JAX. Every line
# is JSON.
#
#   bash tests/bench/gpt_vs_peers.sh [BUILD_DIR]        (ROUNDS=1 STEPS=5 DTYPES="f32 bf16")
#
# DTYPES=f32 leaves bf16 out: on CPUs without bf16 instructions (AVX2 only, e.g. AMD Zen 3) the
# peers' bf16 takes slow fallback paths (PyTorch 2.13's autocast MLP step: 22 s against 0.48 in
# float32), and a bf16 sitting would take hours.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
bench="$build/tests/bench/linum-bench"
steps="${STEPS:-5}"
rounds="${ROUNDS:-1}"
for round in $(seq "$rounds"); do
  for dtype in ${DTYPES:-f32 bf16}; do
    peer_dtype=$([ "$dtype" = f32 ] && echo fp32 || echo bf16)
    for triple in plain:plain:plain remat:ckpt:remat dots::dots; do
      IFS=: read -r variant torch_variant jax_variant <<< "$triple"
      "$bench" gpt --dtype "$dtype" --variant "$variant" --steps "$steps"
      if [ -n "$torch_variant" ]; then
        if [ "$dtype" = bf16 ]; then torch_variant=$([ "$torch_variant" = plain ] && echo bf16 || echo bf16_ckpt); fi
        python3 "$here/torch_gpt.py" --variant "$torch_variant" --steps "$steps" --memory 2>/dev/null
        if [ "$variant" = plain ]; then python3 "$here/torch_gpt.py" --variant "$torch_variant" --steps "$steps" --compile 2>/dev/null; fi
        if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
          /usr/bin/python3 "$here/torch_gpt.py" --variant "$torch_variant" --steps "$steps" --memory 2>/dev/null
        fi
      fi
      python3 "$here/flax_gpt.py" --variant "$jax_variant" --dtype "$peer_dtype" --steps "$steps" 2>/dev/null
    done
  done
done
