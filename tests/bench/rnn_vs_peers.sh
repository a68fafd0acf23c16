#!/usr/bin/env bash
# The LSTM training step (linum-bench rnn: input 64, hidden 256, batch 32), Linum next to its peers in
# one sitting: for each sequence length and round, Linum (plain and remat per step), PyTorch 2
# (pip's torch: nn.LSTM eager and under torch.compile, LSTMCell with checkpoint per step), Debian's
# PyTorch 1.13 when /usr/bin/python3 has torch, and Flax on JAX jit (nn.LSTMCell, OptimizedLSTMCell,
# nn.remat per step), alternating. Every line is JSON; compare the minimum per variant over rounds.
#
# MODEL=gru runs the same sitting for a GRU (nn.GRU, Flax's GRUCell). DTYPE=bf16 runs it in bf16
# (Linum and Flax: bf16 computation, float32 parameters; PyTorch: torch.autocast). MASKED=1 passes
# seq_lengths (Linum and Flax; PyTorch's nn.LSTM has no such argument, so it is left out).
#
#   bash tests/bench/rnn_vs_peers.sh [BUILD_DIR]      (LENGTHS=64,256,1024 ROUNDS=3 STEPS=10 MODEL=lstm DTYPE=f32 MASKED=0)
#
# Each run reports its minimum over STEPS steps, every framework the same number. At T = 64 a step
# takes about 10 ms, and on a shared 2-core host the minimum of 5 was often a slow step for every
# framework (as in mlp_vs_peers.sh); 10 give each a fairer one.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-build}"
bench="$build/tests/bench/linum-bench"
lengths="${LENGTHS:-64,256,1024}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-10}"
model="${MODEL:-lstm}"
dtype="${DTYPE:-f32}"
masked="${MASKED:-0}"
flax_masked=""
[ "$masked" = 1 ] && flax_masked=--masked
flax_variants=lstm,optimized,optimized_remat
[ "$model" = gru ] && flax_variants=gru,gru_remat
for round in $(seq "$rounds"); do
  for T in ${lengths//,/ }; do
    "$bench" rnn --model "$model" --lengths "$T" --steps "$steps" --variants none,per_step,sqrt --dtype "$dtype" --masked "$masked"
    if [ "$masked" != 1 ]; then
      python3 "$here/torch_lstm.py" --model "$model" --lengths "$T" --steps "$steps" --variants nn_lstm,nn_lstm_compile,cell_ckpt \
        --memory --dtype "$dtype"
      if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
        /usr/bin/python3 "$here/torch_lstm.py" --model "$model" --lengths "$T" --steps "$steps" --variants nn_lstm,cell_ckpt --dtype "$dtype"
      fi
    fi
    python3 "$here/flax_lstm.py" --lengths "$T" --steps "$steps" --variants "$flax_variants" --dtype "$dtype" $flax_masked 2>/dev/null
  done
done
