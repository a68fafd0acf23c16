#!/usr/bin/env bash
# linum-bench dp in one sitting: the deep MLP's training step on one process with 2 threads and on
# 2 ranks x 1 thread (fast mode with and without overlap, reproducible mode), alternating for R
# rounds so that machine noise hits every variant alike. One JSON line per run.
#   tests/bench/dp_vs_single.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
bench="$build/tests/bench/linum-bench"
mpirun="mpirun --allow-run-as-root -np 2"
for round in $(seq "$rounds"); do
  "$bench" dp --threads 2 --steps 5
  $mpirun "$bench" dp --threads 1 --steps 5 --reduction fast --overlap 1
  $mpirun "$bench" dp --threads 1 --steps 5 --reduction fast --overlap 0
  $mpirun "$bench" dp --threads 1 --steps 5 --reduction reproducible --micro-batches 2
  "$bench" dp --threads 2 --steps 5 --reduction reproducible --micro-batches 2
done
