#!/usr/bin/env bash
# The paper's phenomena at reduced scale on the real data in ../shared/data, one family of presets per
# phenomenon (configs/experiment/phenomena/<name>/*.yaml, their settings in configs/experiment/settings/),
# 3 seeds per cell, into results/phenomena/<name>/ with its report:
#   scripts/phenomena.sh classifiers|detection|translation|lm|lm_sentence|gan|fp8|lstm_rounding [--report-only]
# Run from the project root of a clean checkout: each record names the commit it ran. A relaunch
# skips the runs already finished (their folders are named from their choices), so a sweep can be
# spread over several sittings. Tarred data is unpacked once into the ignored .data/. SEEDS=0,1
# runs those seeds instead of the presets' own. README, "What we reproduced", says what each shows.
set -euo pipefail
name=${1:?usage: scripts/phenomena.sh classifiers|detection|translation|lm|lm_sentence|gan|fp8|lstm_rounding [--report-only]}
report_only=${2:-}
data=../shared/data
out=results/phenomena/$name

unpack() {  # unpack() <tarball> <folder it holds>
  [ -d ".data/$2" ] || { mkdir -p .data && tar -xzf "$data/$1" -C .data; }
}

presets=$(cd configs/experiment && ls phenomena/"$name"/*.yaml 2>/dev/null | sed 's/\.yaml$//' || true)
if [ -z "$presets" ]; then
  echo "scripts/phenomena.sh: no phenomenon '$name' (expected classifiers, detection, translation, lm, lm_sentence, gan, fp8 or lstm_rounding)" >&2
  exit 2
fi

also=()  # other phenomena's runs this one's report compares against

case $name in
classifiers | fp8) unpack cifar10.tar.gz cifar10 ;;
gan) unpack utkface.tar.gz utkface ;;
esac
shopt -s nullglob  # a baseline not run yet is left out, not passed as a pattern
case $name in
fp8)  # against the FP32 and mixed runs of the settings it shares
  also=(results/phenomena/classifiers/resnet50_fp32_none_* results/phenomena/classifiers/resnet50_mixed_none_*
    results/phenomena/lm/biglstm_tiny_fp32_none_* results/phenomena/lm/biglstm_tiny_mixed_none_*)
  ;;
lstm_rounding)  # against the same FP32 runs, which the gate rounding does not change
  also=(results/phenomena/lm/biglstm_tiny_fp32_none_* results/phenomena/translation/gnmt_small_fp32_none_*)
  ;;
esac
shopt -u nullglob
if [ "$report_only" != --report-only ]; then
  for preset in $presets; do
    python -m mpt.runner.cli -m "experiment=$preset" device=cpu ${SEEDS:+"seed=$SEEDS"} "hydra.sweep.dir=$out"
  done
fi
# The comparisons each sweep makes, in its folder's comparisons*.yaml (declared after the runs, which
# predate declarations in presets, except lm_sentence's): its verdicts in report/tables/comparisons.md.
declared=()
for file in "$out"/comparisons*.yaml; do
  [ -e "$file" ] && declared+=(--comparisons "$file")
done
python -m mpt.report.cli "$out" "${also[@]}" "${declared[@]}" --out "$out/report"
