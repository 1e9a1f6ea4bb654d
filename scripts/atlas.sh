#!/usr/bin/env bash
# The numerics atlas of the six paper models (issue 23) on the real data of ../shared/data, in FP32,
# against FP16, BF16, FP8 E4M3 and E5M2, MXFP8 (E4M3) and MXFP4: each model at initialization (its
# first step sampled) and after a short run (its last step sampled), into results/atlas/<model>/
# with one report over all of them in results/atlas/report/:
#   scripts/atlas.sh [alexnet|resnet50|ssd|gnmt|biglstm|dcgan ...] [--report-only]
# Run from the project root of a clean checkout. A relaunch skips runs already finished. The short
# runs use the settings of scripts/phenomena.sh, shortened; their length is each model's `steps`. Their
# lr milestones are each model's `model.short` ones: ResNet-50's lr falls 10x at steps 50 and 70.
set -euo pipefail
report_only=false
models=()
for arg in "$@"; do
  if [ "$arg" = --report-only ]; then report_only=true; else models+=("$arg"); fi
done
[ ${#models[@]} -gt 0 ] || models=(alexnet resnet50 ssd gnmt biglstm dcgan)
data=../shared/data
formats='stats.formats=[fp16,bf16,e4m3,e5m2,mxfp8_e4m3,mxfp4]'

unpack() {  # unpack() <tarball> <folder it holds>
  [ -d ".data/$2" ] || { mkdir -p .data && tar -xzf "$data/$1" -C .data; }
}

# atlas <name> <steps of the short run> <overrides...>: the run at initialization, then the short run.
atlas() {
  local name=$1 steps=$2
  shift 2
  $report_only && return
  for n in 1 "$steps"; do
    python -m mpt.runner.cli -m "$@" precision=fp32 scale=none device=cpu seed=0 checkpoint=false logger=none "$formats" \
      schedule.steps="$n" stats.every="$n" schedule.eval_every="$n" "hydra.sweep.dir=results/atlas/$name"
  done
}

for model in "${models[@]}"; do
  case $model in
  alexnet | resnet50)
    unpack cifar10.tar.gz cifar10
    size=$([ "$model" = alexnet ] && echo 64 || echo 32)
    lr=$([ "$model" = alexnet ] && echo "optim.lr=0.01 optim.lr_batch=null" || true)
    # shellcheck disable=SC2086
    atlas "$model" 200 model="$model" $lr data=imagefolder data.root=.data/cifar10 data.val_split=test data.resize_ratio=1.0 \
      schedule.batch_size=64 schedule.image_size="$size" schedule.eval_batches=8 schedule.log_every=25
    ;;
  ssd)
    atlas ssd 24 model=ssd data=voc data.root=$data/raccoon 'data.train_sets=[train_labels.csv]' 'data.val_sets=[test_labels.csv]' \
      'data.class_names=[raccoon]' schedule=smoke schedule.batch_size=8 schedule.eval_batches=2 schedule.log_every=4
    ;;
  gnmt)
    atlas gnmt 200 model=gnmt_small data=parallel_text data.root=$data/multi30k data.val_split=val data.vocab_size=8000 \
      schedule.batch_size=64 schedule.eval_batches=2 schedule.log_every=50
    ;;
  biglstm)
    atlas biglstm 500 model=biglstm_tiny data=text_corpus data.root=$data/ptb 'data.train_split=ptb.train.txt*' 'data.val_split=ptb.valid.txt*' 'data.test_split=ptb.test.txt*' \
      data.min_count=1 schedule.batch_size=32 schedule.eval_batches=8 schedule.log_every=50
    ;;
  dcgan)
    unpack utkface.tar.gz utkface
    atlas dcgan 300 model=dcgan64 model.ngf=32 model.ndf=32 data=image_dir data.root=.data/utkface data.val_samples=64 data.num_workers=1 \
      schedule.batch_size=64 schedule.log_every=50
    ;;
  *)
    echo "scripts/atlas.sh: no model '$model' (expected alexnet, resnet50, ssd, gnmt, biglstm or dcgan)" >&2
    exit 2
    ;;
  esac
done
python -m mpt.report.cli results/atlas --out results/atlas/report
