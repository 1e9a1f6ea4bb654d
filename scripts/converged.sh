#!/usr/bin/env bash
# A converged setting: every preset of its family (configs/experiment/<setting>*.yaml, each declaring
# the setting's metric, margin and comparisons before its runs), into results/converged/<setting>/,
# then its report, whose tables/comparisons.md holds the verdicts:
#   scripts/converged.sh cifar10_resnet20|cifar10_airbench|multi30k_gnmt|ptb_biglstm|ptb_gpt [--report-only] [override ...]
# Overrides go to every preset (device=cpu). SEEDS=0,1,2,3,4 runs those seeds and plans them as the
# comparisons' pairs (a GPU's five seeds), instead of the presets' own. A relaunch skips
# the runs already finished and resumes an interrupted one from its checkpoint.
# JOBS=N runs N copies of the loop side by side, each on its share of the CPU's cores (a small run
# does not keep every core busy): each run folder's lock lets one copy run it
# and the others skip to the next, so the copies share out the runs. The report is written once.
set -euo pipefail
setting=${1:?usage: scripts/converged.sh cifar10_resnet20|cifar10_airbench|multi30k_gnmt|ptb_biglstm|ptb_gpt [--report-only] [override ...]}
shift
report_only=false
if [ "${1:-}" = --report-only ]; then
  report_only=true
  shift
fi
out=${OUT:-results/converged/$setting}  # OUT: another folder (a dry run)
presets=$(cd configs/experiment && for f in "$setting".yaml "$setting"_*.yaml; do [ -e "$f" ] && echo "${f%.yaml}"; done || true)
if [ -z "$presets" ] || [ ! -e "configs/experiment/$setting.yaml" ]; then
  echo "scripts/converged.sh: no preset configs/experiment/$setting.yaml (expected cifar10_resnet20, cifar10_airbench, multi30k_gnmt, ptb_biglstm or ptb_gpt)" >&2
  exit 2
fi
if [[ "$setting" == cifar10_* ]] && [ ! -d .data/cifar10 ]; then
  mkdir -p .data && tar -xzf ../shared/data/cifar10.tar.gz -C .data  # the presets read .data/cifar10
fi
# One sweep per preset: a preset's cells are its own sweeper's (a sweep over presets would not apply them).
planned=()
[ -z "${SEEDS:-}" ] || planned=("seed=$SEEDS" "experiment.seeds=[$SEEDS]")
sweeps() {
  for preset in $presets; do
    python -m mpt.runner.cli -m "experiment=$preset" "hydra.sweep.dir=$out" "${planned[@]}" "$@"
  done
}
jobs=${JOBS:-1}
if ! $report_only; then
  if [ "$jobs" -gt 1 ]; then
    threads=$(( $(nproc) / jobs )); [ "$threads" -ge 1 ] || threads=1
    mkdir -p "$out"
    for j in $(seq "$jobs"); do
      OMP_NUM_THREADS=$threads sweeps "$@" > "$out/job$j.log" 2>&1 &
      sleep 5  # the first copy takes the first run's lock before the next looks
    done
    wait
  else
    sweeps "$@"
  fi
fi
python -m mpt.report.cli "$out" --out "$out/report"
