#!/usr/bin/env bash
# Calibrate the demo model on this machine, then validate on the held-out runs; results under
# benchmarks/results/. Usage: benchmarks/calibration_accuracy.sh [extra gpipe calibrate flags]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=(--model transformer --layers 4 --d-model 128 --ff 512 --heads 4 --seq 32 --vocab 256 --batch 32)
mkdir -p benchmarks/results
uptime | sed 's/^/load before: /'
.venv/bin/gpipe calibrate "${MODEL[@]}" --out benchmarks/results/calibration_costs_cpu.json --force "$@"
.venv/bin/gpipe validate --costs benchmarks/results/calibration_costs_cpu.json --steps 10 --rounds 6 \
    --out benchmarks/results/calibration_validation_cpu.json
uptime | sed 's/^/load after: /'
