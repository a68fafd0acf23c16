#!/usr/bin/env bash
# The deep-MLP step (24 x Dense(512) + GELU, batch 2048), Linum next to today's peers in one
# sitting, alternating per variant and dtype: PyTorch 2 from pip (eager, and torch.compile for the
# plain step), Flax on JAX jit (nn.remat per layer, per sqrt(L) segments, and the dots_saveable
# policy), and Debian's PyTorch 1.13 when /usr/bin/python3 has torch. Every line is JSON.
#
#   bash tests/bench/mlp_vs_peers.sh [BUILD_DIR]        (ROUNDS=1 STEPS=10 DTYPES="f32 bf16")
#
# DTYPES=f32 leaves bf16 out: on CPUs without bf16 instructions (AVX2 only, e.g. AMD Zen 3) the
# peers' bf16 takes slow fallback paths (PyTorch 2.13's autocast MLP step: 22 s against 0.48 in
# float32), and a bf16 sitting would take hours.
#
# Each run reports its minimum over STEPS steps. On a shared 2-core host a minimum of 5 was often
# a slow step for every framework; 10 give each a fairer one (and Linum's gemm_ratio compares its
# step's minimum with the best of 20 products timed in the same run).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
bench="$build/tests/bench/linum-bench"
steps="${STEPS:-10}"
rounds="${ROUNDS:-1}"
for round in $(seq "$rounds"); do
  for dtype in ${DTYPES:-f32 bf16}; do
    peer_dtype=$([ "$dtype" = f32 ] && echo fp32 || echo bf16)
    for pair in plain:none:none remat_every:every:every remat_sqrt:sqrt:sqrt remat_dots::dots; do
      IFS=: read -r variant torch_mode jax_mode <<< "$pair"
      "$bench" mlp --dtype "$dtype" --variant "$variant" --steps "$steps"
      if [ -n "$torch_mode" ]; then
        STEPS="$steps" python3 "$here/torch_mlp.py" "$torch_mode" "$peer_dtype"
        if [ "$torch_mode" = none ]; then COMPILE=1 STEPS="$steps" python3 "$here/torch_mlp.py" none "$peer_dtype"; fi
        if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
          STEPS="$steps" /usr/bin/python3 "$here/torch_mlp.py" "$torch_mode" "$peer_dtype"
        fi
      fi
      STEPS="$steps" python3 "$here/flax_mlp.py" "$jax_mode" "$peer_dtype" 2>/dev/null
    done
  done
done
