#!/usr/bin/env bash
# Calibrate the demo model on this machine CALIBRATIONS times (default 2), one after the other, then
# validate on the held-out runs, each measured once and judged by every calibration; results under
# benchmarks/results/. Usage: [CALIBRATIONS=N] benchmarks/calibration_accuracy.sh [extra gpipe calibrate flags]
# About 10 minutes per calibration and 13 for the validation on 2 cores: the design runs are measured
# in 6 rounds and every held-out run in 15, because one round of a run on a shared VM spreads by
# about 10%, and a calibration taken at another stretch of minutes moves every error (see
# benchmarks/README.md). The first calibration's file is the one the summary's errors are of.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=(--model transformer --layers 4 --d-model 128 --ff 512 --heads 4 --seq 32 --vocab 256 --batch 32)
CALIBRATIONS=${CALIBRATIONS:-2}
mkdir -p benchmarks/results
uptime | sed 's/^/load before: /'
COSTS=(benchmarks/results/calibration_costs_cpu.json)
for ((n = 2; n <= CALIBRATIONS; n++)); do COSTS+=("benchmarks/results/calibration_costs_cpu_$n.json"); done
for costs in "${COSTS[@]}"; do
    .venv/bin/gpipe calibrate "${MODEL[@]}" --out "$costs" --force --rounds 6 "$@"
done
.venv/bin/gpipe validate --costs "${COSTS[@]}" --steps 10 --rounds 15 \
    --out benchmarks/results/calibration_validation_cpu.json
uptime | sed 's/^/load after: /'
