#!/usr/bin/env bash
# The numerics atlas of the six paper models, and GPT-2's architecture beyond the paper, on the real
# data of ../shared/data, in FP32, against FP16, BF16, FP8 E4M3 and E5M2, MXFP8 (E4M3) and MXFP4: each
# model at initialization (its first step sampled) and after a short run (its last step sampled), the
# presets configs/experiment/atlas/<model>/, into results/atlas/<model>/, with one report over all of
# them in results/atlas/report/:
#   scripts/atlas.sh [alexnet|resnet50|ssd|gnmt|biglstm|dcgan|gpt2 ...] [--report-only]
# Run from the project root of a clean checkout. A relaunch skips runs already finished.
set -euo pipefail
report_only=false
models=()
for arg in "$@"; do
  if [ "$arg" = --report-only ]; then report_only=true; else models+=("$arg"); fi
done
[ ${#models[@]} -gt 0 ] || models=(alexnet resnet50 ssd gnmt biglstm dcgan gpt2)

unpack() {  # unpack() <tarball> <folder it holds>
  [ -d ".data/$2" ] || { mkdir -p .data && tar -xzf "../shared/data/$1" -C .data; }
}

for model in "${models[@]}"; do
  if [ ! -d "configs/experiment/atlas/$model" ]; then
    echo "scripts/atlas.sh: no model '$model' (expected alexnet, resnet50, ssd, gnmt, biglstm, dcgan or gpt2)" >&2
    exit 2
  fi
  $report_only && continue
  case $model in
  alexnet | resnet50) unpack cifar10.tar.gz cifar10 ;;
  dcgan) unpack utkface.tar.gz utkface ;;
  esac
  for preset in $(cd configs/experiment && ls atlas/"$model"/*.yaml | sed 's/\.yaml$//'); do
    python -m mpt.runner.cli -m "experiment=$preset" device=cpu "hydra.sweep.dir=results/atlas/$model"
  done
done
python -m mpt.report.cli results/atlas --out results/atlas/report
