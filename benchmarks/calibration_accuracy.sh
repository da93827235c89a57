#!/usr/bin/env bash
# Calibrate the demo model on this machine, then validate on the held-out runs; results under
# benchmarks/results/. Usage: benchmarks/calibration_accuracy.sh [extra gpipe calibrate flags]
# About 6-7 minutes on 2 cores: the design runs are measured in 6 rounds and every held-out run in
# 15, because one round of a run on a shared VM spreads by about 10% (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=(--model transformer --layers 4 --d-model 128 --ff 512 --heads 4 --seq 32 --vocab 256 --batch 32)
mkdir -p benchmarks/results
uptime | sed 's/^/load before: /'
.venv/bin/gpipe calibrate "${MODEL[@]}" --out benchmarks/results/calibration_costs_cpu.json --force --rounds 6 "$@"
.venv/bin/gpipe validate --costs benchmarks/results/calibration_costs_cpu.json --steps 10 --rounds 15 \
    --out benchmarks/results/calibration_validation_cpu.json
uptime | sed 's/^/load after: /'
