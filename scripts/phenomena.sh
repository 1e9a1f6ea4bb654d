#!/usr/bin/env bash
# The paper's phenomena at reduced scale on the real data in ../shared/data (issue 21), one sweep per
# phenomenon, 3 seeds per cell, into results/phenomena/<name>/ with its report:
#   scripts/phenomena.sh classifiers|detection|translation|lm|lm_sentence|gan|fp8|lstm_rounding [--report-only]
# Run from the project root of a clean checkout: each record names the commit it ran. A relaunch
# skips the runs already finished (their folders are named from their choices), so a sweep can be
# spread over several sittings. Tarred data is unpacked once into the ignored .data/. Sizes and
# schedules are chosen to fit the whole set into about 10 hours on 2 CPU cores; every schedule's
# learning rate falls 100x (two drops of 10x, at 1/2 and 3/4 of the run, or at epochs), since
# updates are lost only once it is small. README, "What we reproduced", says what each one shows.
set -euo pipefail
name=${1:?usage: scripts/phenomena.sh classifiers|detection|translation|lm|lm_sentence|gan|fp8|lstm_rounding [--report-only]}
report_only=${2:-}
data=../shared/data
out=results/phenomena/$name

unpack() {  # unpack() <tarball> <folder it holds>
  [ -d ".data/$2" ] || { mkdir -p .data && tar -xzf "$data/$1" -C .data; }
}

sweep() {
  [ "$report_only" = --report-only ] || python -m mpt.runner.cli -m "$@" device=cpu "seed=${seeds:-0,1,2}" checkpoint=false "hydra.sweep.dir=$out"
}

also=()  # other phenomena's runs this one's report compares against

classifier() {  # classifier <model>: the classifier setting's overrides, into `common`
  local model=$1 steps=600
  local size=$([ "$model" = alexnet ] && echo 64 || echo 32)
  local lr=$([ "$model" = alexnet ] && echo "optim.lr=0.01 optim.lr_batch=null" || true)
  common=(model=$model $lr data=imagefolder data.root=.data/cifar10 data.val_split=test data.resize_ratio=1.0
    schedule.batch_size=64 schedule.image_size=$size schedule.steps=$steps "schedule.lr_milestones=[$((steps / 2)),$((steps * 3 / 4))]"
    schedule.eval_every=$((steps / 4)) schedule.eval_batches=null schedule.log_every=25
    stats.lost_updates=true stats.every=50)
}

language_model() {  # the language-model setting's overrides, into `common`
  common=(model=biglstm_tiny data=text_corpus data.root=$data/ptb 'data.train_split=ptb.train.txt*' 'data.val_split=ptb.valid.txt*'
    'data.test_split=ptb.test.txt*' data.min_count=1 schedule.batch_size=32 schedule.steps=null schedule.epochs=3
    'schedule.lr_milestones=[1.5,2.5]' schedule.eval_every=null schedule.eval_batches=null schedule.log_every=50
    stats.lost_updates=true stats.every=100)
}

translation_model() {  # the translation setting's overrides, into `common`
  # GNMT at 128 units on Multi30k en-de (29,000 pairs; an 8,000-piece sentencepiece vocabulary
  # trained on them), 2 epochs of batch 64 (900 steps), Adam 5e-3 falling 10x at epoch 1 and again
  # at 1.5; BLEU on test_2016_flickr (1,000 sentences), validation on 512 of val's.
  common=(model=gnmt_small data=parallel_text data.root=$data/multi30k data.val_split=val data.test_split=test_2016_flickr data.vocab_size=8000
    schedule.batch_size=64 schedule.steps=null schedule.epochs=2 'schedule.lr_milestones=[1.0,1.5]' schedule.eval_every=null schedule.eval_batches=8
    schedule.log_every=50 stats.grad_hist=true stats.lost_updates=true stats.every=50)
}

case $name in
classifiers)
  # The paper's Table 1 and the seeds' FP16 results: CIFAR-10 (50,000 training, 10,000 test images),
  # ResNet-50 at 32 px and AlexNet at 64 px (its three 3x3/2 poolings leave nothing of 32 px;
  # the images are upsampled), each model's ImageNet recipe (SGD, momentum 0.9, lr per 256 images)
  # at batch 64, the test images whole (resize_ratio 1). ResNet-50 takes its recipe's lr scaled
  # linearly, 0.025. AlexNet takes 0.01 as given, Krizhevsky's lr at batch 128: scaled linearly
  # (0.0025) its loss stays at chance, 2.30, for the first 200 of the 600 steps
  # (results/cpu-classifier-probe/schedule/). AlexNet runs first: it is the cheaper half.
  unpack cifar10.tar.gz cifar10
  for model in alexnet resnet50; do
    classifier $model
    sweep "${common[@]}" precision=fp32,mixed,fp16 scale=none
    sweep "${common[@]}" precision=fp16,fp16_modmom scale=static  # the model's static scale, 1000
  done
  ;;
lm)
  # bigLSTM's structure at 2 x 256 cells (projection 64) on PTB, 3 epochs of batch 32 (4,356 steps),
  # Adagrad 0.2 falling to 0.02 at epoch 1.5 and to 0.002 at 2.5; perplexity on the full softmax.
  language_model
  # The first sweep ran with checkpoint=false, device=cpu and the seeds given before these (the order
  # does not change a run's folder).
  sweep "${common[@]}" precision=fp32,mixed scale=none
  sweep "${common[@]}" precision=mixed scale=static scale.value=128
  # Where the gradients lie against FP16's range, for the verdict on loss scaling: FP32, one seed.
  seeds=0 sweep "${common[@]}" stats.grad_hist=true precision=fp32 scale=none
  ;;
detection)
  # Multibox SSD300 (VGG-16, random init: no ImageNet weights here) on the raccoon set (160
  # training images, 40 test), batch 8, 48 steps (2.4 epochs), the recipe's SGD at 2.5e-4 (8e-3 per
  # 256 images) falling 10x at steps 24 and 36. SSD300 trains at under an image per second on 2
  # cores (0.86-0.87 alone, the records of mixed + 8 seeds 1 and 2), so this is what 9 runs afford:
  # its mAP is noise, and what it can show is where the gradients lie (sampled every 8th step, start
  # to end) and whether mixed without scaling breaks.
  common=(model=ssd data=voc data.root=$data/raccoon 'data.train_sets=[train_labels.csv]' 'data.val_sets=[test_labels.csv]' 'data.class_names=[raccoon]'
    schedule=smoke schedule.batch_size=8 schedule.steps=48 'schedule.lr_milestones=[24,36]' schedule.eval_batches=null schedule.log_every=4
    schedule.throughput_warmup=2 schedule.throughput_window=4 stats.grad_hist=true stats.lost_updates=true stats.every=8)
  sweep "${common[@]}" precision=fp32,mixed scale=none
  sweep "${common[@]}" precision=mixed scale=static  # the model's static scale, the paper's 8
  ;;
translation)
  translation_model
  sweep "${common[@]}" precision=fp32,mixed scale=none
  sweep "${common[@]}" precision=mixed scale=static scale.value=1024
  sweep "${common[@]}" precision=mixed scale=none model.loss_reduction=sum
  ;;
fp8)
  # Issue 24: training in FP8 and MX formats, in the classifier setting (ResNet-50 at 32 px) and the
  # language-model setting above, against their FP32 and mixed runs (reused from those sweeps, which
  # ran the same settings). No loss scaling: every mode here computes outside its products in BF16.
  unpack cifar10.tar.gz cifar10
  classifier resnet50
  sweep "${common[@]}" precision=bf16,fp8,fp8_delayed,mxfp8,mxfp4 scale=none
  # The atlas of the FP8 run (seed 0): its products' tensors against the formats it and the MX modes use.
  seeds=0 sweep "${common[@]}" precision=fp8 scale=none stats.every=300 'stats.formats=[e4m3,e5m2,mxfp8_e4m3,mxfp8_e5m2,mxfp4,mxfp6_e3m2]'
  language_model
  sweep "${common[@]}" precision=bf16,fp8,fp8_delayed scale=none
  # And the language model's (seed 0), at the start, middle and end of its 4,356 steps.
  seeds=0 sweep "${common[@]}" precision=fp8 scale=none stats.every=1452 'stats.formats=[e4m3,e5m2,mxfp8_e4m3,mxfp8_e5m2,mxfp4,mxfp6_e3m2]'
  # The MX modes emulate at 5.1-5.5x FP32's cost here (results/cpu-modes-fp8/), the sweep's longest part:
  # seed 0 of each first, so that a sitting that ends early still has every mode.
  seeds=0 sweep "${common[@]}" precision=mxfp8,mxfp4 scale=none
  # MXFP4's lead (docs/reproduction.md): the sampled softmax's true-word logit through a quantized
  # product as the negatives' are (model.true_logit=product). Seed 0 first, beside seed 0 above.
  seeds=0 sweep "${common[@]}" precision=mxfp4 scale=none model.true_logit=product
  seeds=1,2 sweep "${common[@]}" precision=mxfp8,mxfp4 scale=none
  seeds=1,2 sweep "${common[@]}" precision=mxfp4 scale=none model.true_logit=product
  sweep "${common[@]}" precision=mxfp8 scale=none model.true_logit=product
  shopt -s nullglob  # a baseline not run yet is left out, not passed as a pattern
  also=(results/phenomena/classifiers/resnet50_fp32_none_* results/phenomena/classifiers/resnet50_mixed_none_*
    results/phenomena/lm/biglstm_tiny_fp32_none_* results/phenomena/lm/biglstm_tiny_mixed_none_*)
  ;;
lm_sentence)
  # The cells of `lm` again, each sentence scored from a zero state (model.eval_state=sentence):
  # `lm` carried the state across the split, where one latched stream can double a perplexity
  # (docs/tasks-and-data.md, "Language-model evaluation"). Their own folder: `lm`'s mixed runs
  # predate the LSTM gate rounding, so a relaunch of `lm` would make them again.
  language_model
  sweep "${common[@]}" model.eval_state=sentence precision=fp32,mixed scale=none
  sweep "${common[@]}" model.eval_state=sentence precision=mixed scale=static scale.value=128
  ;;
lstm_rounding)
  # The LSTM cells of `lm`, `translation` and `fp8` that compute in FP16 or BF16, again under the
  # emulation that rounds each gate product as an H100's cuDNN does (7fba77d; those sweeps ran with
  # the unrounded sums), against the same FP32 runs, which it does not change. bigLSTM first: it is
  # the cheaper half.
  language_model
  sweep "${common[@]}" precision=mixed scale=none
  sweep "${common[@]}" precision=mixed scale=static scale.value=128
  sweep "${common[@]}" precision=bf16 scale=none
  translation_model
  sweep "${common[@]}" precision=mixed scale=none
  sweep "${common[@]}" precision=mixed scale=static scale.value=1024
  # GNMT's mixed without scaling ended below FP32's training loss in each of seeds 0-2: two more
  # seeds of both, to see whether that holds beyond three pairs.
  seeds=3,4 sweep "${common[@]}" precision=fp32,mixed scale=none
  shopt -s nullglob
  also=(results/phenomena/lm/biglstm_tiny_fp32_none_* results/phenomena/translation/gnmt_small_fp32_none_*)
  ;;
gan)
  # Radford's 64x64 DCGAN at half width (ngf = ndf = 32) on the 4,741 UTKFace faces, 1,200 steps of
  # batch 64 (16 epochs), Adam 2e-4 falling 10x at steps 600 and 900; a fixed-noise grid every 300.
  unpack utkface.tar.gz utkface
  sweep model=dcgan64 model.ngf=32 model.ndf=32 data=image_dir data.root=.data/utkface data.val_samples=256 data.num_workers=1 \
    schedule.batch_size=64 schedule.steps=1200 'schedule.lr_milestones=[600,900]' schedule.eval_every=300 schedule.log_every=50 \
    stats.lost_updates=true stats.every=50 precision=fp32,mixed scale=none
  ;;
*)
  echo "scripts/phenomena.sh: no phenomenon '$name' (expected classifiers, detection, translation, lm, lm_sentence, gan, fp8 or lstm_rounding)" >&2
  exit 2
  ;;
esac
# The comparisons each sweep makes, in its folder's comparisons*.yaml (declared after the runs, which
# predate declarations in presets, except lm_sentence's): its verdicts in report/tables/comparisons.md.
declared=()
for file in "$out"/comparisons*.yaml; do
  [ -e "$file" ] && declared+=(--comparisons "$file")
done
python -m mpt.report.cli "$out" "${also[@]}" "${declared[@]}" --out "$out/report"
