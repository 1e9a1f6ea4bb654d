#!/usr/bin/env bash
# Issue 11's GPU measurements, one part per call of the device tool (each call has 10 minutes).
#
# Here, first:   scripts/device/device_carry.sh PART     (fills the ignored .whl/ and .data/ for PART)
# On the GPU:    scripts/device/device_session.sh PART [extra mpt-run overrides ...]
#   with carry=[".whl", ".data"]; it installs the wheels, runs PART in /tmp/mpt/PART and leaves
#   one $OUT/PART.tar.gz (records, logs, pictures; no checkpoints): the device tool returns 8 files.
#
# PART:
#   suite      the CUDA test suite, `python -m pytest -m gpu` (SUITE_TIMEOUT seconds at most, 300 by default)
#   arithmetic scripts/probe_cuda_arithmetic.py: cuBLAS's and cuDNN's FP16/BF16 products against one rounding;
#              scripts/probe_cuda_lstm.py: which rounding points reproduce cuDNN's LSTM step
#              (PROBES=lstm or PROBES=products runs one of the two)
#   bench      experiment=throughput over the paper's six models and fp32,tf32,fp16,mixed,amp,bf16
#              (MODELS=alexnet,resnet50 and PRECISIONS=... narrow it, to split it over several calls)
#   options    ResNet-50 amp at schedule=bench with each speed option off and on
#   peer       scripts/peer_resnet50.py: NVIDIA DeepLearningExamples' ResNet-50 beside ours
#   cifar      CIFAR-10 AlexNet and ResNet-50: fp32, mixed, fp16 without scaling, fp16_modmom + static, 3 seeds
#              (MODELS=alexnet narrows the models; SEEDS=0 the seeds of every phenomenon: split the long
#              parts over several calls. Extra arguments are added to every mpt-run; a key already set
#              here cannot be given again.)
#   ssd        raccoon VOC SSD: fp32 (with gradient histograms), mixed without scaling, mixed with scale 8, 3 seeds
#   gnmt       Multi30k GNMT (gnmt_small): fp32, mixed without scaling, mixed with static scaling, 3 seeds
#   biglstm    PTB bigLSTM (biglstm_small): fp32, mixed without scaling, mixed with scale 128, 3 seeds
#   dcgan      UTKFace DCGAN: fp32 and mixed sample grids, 3 seeds
#   next       what the loans so far left, in one call of at most 8 minutes (scripts/device/device_carry.sh next): the
#              LSTM comparisons against the emulation that now rounds each gate product and the
#              CUDA-graphs test that now asserts a compiled graph, the torch.compile rows of the
#              speed options (the third loan's compiled nothing) beside eager, and DCGAN's FP32
#              peak after the warm-up, each part under its own time limit (PART_SECONDS), each
#              leaving its own tarball
#   classifier what `others` runs
#   others     the second call after `next`, at most 5 minutes (the same carry): ResNet-50's cells of
#              the CPU classifier sweep (scripts/phenomena.sh classifiers: CIFAR-10 at 32 px, batch
#              64, 600 steps: its presets phenomena/classifiers/3_resnet50, _static), seed 0, on CUDA's own kernels
#   sequences  the language model's and GNMT's converged settings (ptb_biglstm, _mixed; multi30k_gnmt,
#              _mixed, _fp16, _adam, _adam_mixed), seeds 0-2 planned (PLAN; SEEDS runs some), seed-major; then
#              bigLSTM's long run without scaling (ptb_biglstm_long) until the part's deadline.
#              Records in lm/, mt/ and long/.
#   gpt        beyond the paper, GPT-2's architecture on PTB (ptb_gpt: fp32, bf16, fp8, mxfp8), seeds 0-2
#              planned (PLAN; SEEDS runs some), seed-major. Records in gpt/.
#   speed      the speed goals' measurements, in their order (experiment=speed_*: FP8 LSTMs against BF16,
#              the dynamic scaler's cost, BF16 against amp on batch-norm networks, torch.compile against
#              eager, ResNet-50 on full-size JPEGs decoded on the host and on the GPU), each a ratio of
#              two rows of one call. Records in speed/. Last, scripts/profile_step.py: three profiled
#              steps of each cell of speed_norm, speed_fp8_lstm and _fused, into speed/profile/.
#   accuracy   the converged CIFAR-10 grid (experiment=cifar10_airbench, _mixed, _amp, _fp16: 13 cells), seeds
#              0-4 planned (PLAN), seed-major: every cell's seed 0, then every cell's seed 1, ...; then
#              the loss-scaling control (cifar10_airbench_shift: k = 0, 12, 24, seeds 0-1). A later call
#              finishes a cut-off grid with SEEDS=3,4 SHIFT_SEEDS= (the same plan, the seeds left).
#              Records in grid/ and shift/, CIFAR-10 decoded once and kept on the GPU (data.resident).
#
# DRY_RUN=1: the part on this machine's CPU, without wheels, GPU or carried commit: the same runs,
# two steps each, on ../shared/data (accuracy, sequences and gpt; tests/test_device_session.py, PLAN=0,1).
#
# PART_SECONDS=N: the part stops its commands N seconds after it starts (runs get SIGTERM, stop
# after a step and record `preempted`; the suite gets SIGINT, so pytest reports), and still packs.
set -uo pipefail
part=${1:?usage: scripts/device/device_session.sh PART [overrides...]}
shift
if [ "$part" = next ]; then
  PART_SECONDS=170 bash "$0" suite -k "cpu_lstm or cuda_graphs"
  PART_SECONDS=220 COMPILE_ONLY=1 bash "$0" options schedule.steps=60
  PART_SECONDS=60 MODELS=dcgan PRECISIONS=fp32 bash "$0" bench schedule.steps=60
  exit 0
fi
if [ "$part" = others ]; then
  PART_SECONDS=280 bash "$0" classifier "$@"
  exit 0
fi
deadline=$(($(date +%s) + ${PART_SECONDS:-86400}))
# A command under the part's deadline. timeout puts the command in a process group of its own, so
# the signal reaches it and not this script, its packer or the tee after it.
limited() {
  local left=$((deadline - $(date +%s)))
  [ "$left" -gt 0 ] || { echo "device_session.sh $part: no time left for: $*"; return 124; }
  timeout -k 20 "$left" "$@"
}
OUT=${OUT:-/tmp/out}
base=${WORK:-/tmp/mpt}  # WORK: another folder for the parts' runs (a dry run's)
W=$base/$part
mkdir -p "$OUT" "$W"
dry=${DRY_RUN:-}
if [ -z "$dry" ]; then
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
# Uninstalled, mpt.configs is where pip puts configs/ (pyproject.toml's package-dir).
[ -e mpt/configs ] || ln -s ../configs mpt/configs
nvidia-smi -L | tee "$W/device.txt"
# The records name the commit device_carry.sh read, and are marked dirty if the tracked files here
# are not the ones it hashed (the tree changed since).
read -r MPT_GIT_COMMIT MPT_GIT_DIRTY packed_hash < .data/GIT
here_hash=$(tr '\n' '\0' < .data/GIT_FILES | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ "$here_hash" != "$packed_hash" ]; then
  echo "device_session.sh: the tracked files differ from what device_carry.sh hashed at $MPT_GIT_COMMIT; records say dirty" | tee -a "$W/device.txt"
  MPT_GIT_DIRTY=1
fi
export MPT_GIT_COMMIT MPT_GIT_DIRTY
# The copy may carry a stale .git of its own, which record.py would ask before MPT_GIT_COMMIT (the
# first GPU call's records named the session's first commit): hide it.
export GIT_DIR=/nonexistent
echo "commit $MPT_GIT_COMMIT dirty $MPT_GIT_DIRTY" >> "$W/device.txt"
else
  echo "dry run on $(nproc) CPU cores" | tee "$W/device.txt"
fi
# After every command the tarball is rewritten: a call cut off by its time limit still returns
# the runs that finished (the device tool returns only what is under $OUT).
# It is also rewritten every minute meanwhile, so a sweep cut off midway returns its finished runs.
rc=0
pack() { tar --exclude=checkpoint.pt -czf "$W.$BASHPID.tgz" -C "$base" "$part" 2>/dev/null && mv -f "$W.$BASHPID.tgz" "$OUT/$part.tar.gz"; }
run() { limited python3 -m mpt.runner.cli "$@" 2>&1 | tee -a "$W/$part.log" || rc=$?; pack; }
( while sleep 60; do pack; done ) &
packer=$!
trap 'kill $packer 2>/dev/null' EXIT
cifar_root() {  # CIFAR-10 unpacked once; the folder that holds its train/ and test/
  [ -d /tmp/cifar ] || { mkdir -p /tmp/cifar && tar -xzf "$D/cifar10.tar.gz" -C /tmp/cifar; }
  dirname "$(find /tmp/cifar -maxdepth 3 -type d -name train | head -1)"
}
D=$PWD/.data

case $part in
  suite)
    # SIGINT: pytest stops and prints its summary. (SIGTERM is a run's preemption signal: each test's
    # run would stop after a step, recorded `preempted`, and pytest would go on past the limit.)
    limit=$((deadline - $(date +%s))) && [ "$limit" -lt "${SUITE_TIMEOUT:-300}" ] || limit=${SUITE_TIMEOUT:-300}
    timeout -s INT -k 30 "$limit" python3 -m pytest -m gpu -v -rA --durations=25 -p no:cacheprovider --basetemp=/tmp/mpt-suite tests "$@" 2>&1 | tee -a "$W/$part.log"
    rc=${PIPESTATUS[0]}
    pack ;;
  arithmetic)
    probes=,${PROBES:-products,lstm},
    if [[ $probes == *,products,* ]]; then
      limited python3 scripts/probe_cuda_arithmetic.py --out "$W/arithmetic.json" 2>&1 | tee -a "$W/$part.log" || rc=$?
    fi
    if [[ $probes == *,lstm,* ]]; then
      limited python3 scripts/probe_cuda_lstm.py --out "$W/lstm.json" 2>&1 | tee -a "$W/$part.log" || rc=$?
    fi
    pack ;;
  bench)
    run -m experiment=throughput model=${MODELS:-alexnet,resnet50,ssd,gnmt,biglstm,dcgan} precision=${PRECISIONS:-fp32,tf32,fp16,mixed,amp,bf16} \
        hydra.sweep.dir="$W/bench" "$@" ;;
  options)
    base=(-m experiment=throughput model=resnet50 precision=amp)
    if [ -n "${COMPILE_ONLY:-}" ]; then  # eager beside the compiled rows, in the same call
      run "${base[@]}" compile.backend=null hydra.sweep.dir="$W/options" "$@"
      run "${base[@]}" compile.backend=inductor compile.mode=default hydra.sweep.dir="$W/options" "$@"
      run "${base[@]}" compile.backend=inductor compile.mode=reduce-overhead hydra.sweep.dir="$W/options" "$@"
      pack
      exit $rc
    fi
    run "${base[@]}" channels_last=false,true hydra.sweep.dir="$W/options" "$@"
    run "${base[@]}" cudnn_benchmark=false hydra.sweep.dir="$W/options" "$@"
    run "${base[@]}" optim.implementation=foreach,fused hydra.sweep.dir="$W/options" "$@"
    run "${base[@]}" compile.backend=inductor compile.mode=default,reduce-overhead,max-autotune-no-cudagraphs hydra.sweep.dir="$W/options" "$@" ;;
  peer)
    limited python3 scripts/peer_resnet50.py --peer "$D/peer/ConvNets" --peer-commit "$(cat "$D/peer/COMMIT")" \
        --pythonpath "$D/peer/dllogger" --out "$W/peer" "$@" 2>&1 | tee -a "$W/$part.log" || rc=$?
    pack ;;
  accuracy)
    # Seed-major over the four presets, so that a call cut off by its limit has every cell's first
    # seeds. Every run plans all of PLAN, so that the report calls a cut-off grid incomplete; SEEDS
    # runs some of them (a later call's share), SHIFT_SEEDS the control's (empty: none).
    plan=${PLAN:-0,1,2,3,4}
    grid_seeds=${SEEDS:-$plan}
    common=(checkpoint=false "data.cache_dir=$base/cache")
    if [ -n "$dry" ]; then
      root=$(cd ../shared/data/cifar10-mini && pwd)
      common+=(device=cpu schedule.steps=2 schedule.epochs=null schedule.batch_size=100 data.num_workers=0)
    else
      root=$(cifar_root)
      common+=(device=cuda)
    fi
    for s in ${grid_seeds//,/ }; do
      for preset in cifar10_airbench cifar10_airbench_mixed cifar10_airbench_amp cifar10_airbench_fp16; do
        run -m "experiment=$preset" "seed=$s" "experiment.seeds=[$plan]" data=imagefolder "data.root=$root" "${common[@]}" \
            hydra.sweep.dir="$W/grid" "$@"
      done
    done
    shift_seeds=${SHIFT_SEEDS-0,1}
    for s in ${shift_seeds//,/ }; do  # the preset plans seeds 0 and 1
      run -m experiment=cifar10_airbench_shift "seed=$s" data=imagefolder "data.root=$root" "${common[@]}" hydra.sweep.dir="$W/shift" "$@"
    done ;;
  speed)
    # Each preset's rows and its baseline's run in this one call; a cut-off call has the first goals'.
    common=(checkpoint=false hydra.sweep.dir="$W/speed")
    # as many JPEGs as the bench's 120 steps of 256 take, so that no timing window holds an epoch's
    # end, where the loader's workers restart with nothing prefetched
    lstm=() compile=() cell=() jpegs=/tmp/jpegs images=30720 shape=() profiled=(--warmup 10 --steps 3)
    if [ -n "$dry" ]; then  # small models and shapes, two steps; dynamo without inductor's C++ build
      shape=(device=cpu schedule.batch_size=4)
      common+=("${shape[@]}" schedule.steps=2 schedule.throughput_warmup=1 schedule.throughput_window=1)
      lstm=(model=gnmt_small,biglstm_tiny) compile=(compile.backend=aot_eager compile.mode=null) jpegs=$base/jpegs images=20
      cell=(precision.products.fused_cell=aot_eager)
      profiled=(--warmup 1 --steps 1)
    else
      common+=(device=cuda) shape=(device=cuda)
    fi
    run -m experiment=speed_fp8_lstm "${lstm[@]}" "${common[@]}" "$@"
    run -m experiment=speed_fp8_lstm_fused "${lstm[@]}" "${cell[@]}" "${common[@]}" "$@"
    run -m experiment=speed_scaler "${common[@]}" "$@"
    run -m experiment=speed_norm "${common[@]}" "$@"
    run -m experiment=speed_compile "${compile[@]}" "${common[@]}" "$@"
    if [ ! -e "$jpegs/COMPLETE" ]; then  # a tree a cut-off call left half-made is made again
      rm -rf "$jpegs"
      limited python3 scripts/make_jpegs.py --out "$jpegs" --images "$images" 2>&1 | tee -a "$W/$part.log" || rc=$?
    fi
    [ -e "$jpegs/COMPLETE" ] && run -m experiment=speed_jpeg "data.root=$jpegs" "${common[@]}" "$@"
    # Where the step's time goes: batch-norm's kernels (cuDNN's or native) for BF16 against amp, and
    # the FP8 LSTM's weight quantizations per pass
    profile() { limited python3 scripts/profile_step.py "${profiled[@]}" --out "$W/speed/profile" "$@" 2>&1 | tee -a "$W/$part.log" || rc=$?; pack; }
    profile --preset speed_norm "${shape[@]}"
    profile --preset speed_fp8_lstm "${lstm[@]}" "${shape[@]}"
    profile --preset speed_fp8_lstm_fused "${lstm[@]}" "${cell[@]}" "${shape[@]}" ;;
  sequences)
    # The sequence models' converged settings, seed-major as accuracy's grid, then bigLSTM's long
    # unscaled run for whatever time is left (stopped by the deadline, recorded `preempted`).
    plan=${PLAN:-0,1,2}
    grid_seeds=${SEEDS:-$plan}
    common=(checkpoint=false)
    if [ -n "$dry" ]; then
      data=$(cd ../shared/data && pwd)
      common+=(device=cpu schedule.steps=2 schedule.epochs=null)
      long=(schedule.steps=4 stats.every=2 schedule.eval_every=4 schedule.checkpoint_every=4)
    else
      data=$D
      common+=(device=cuda)
      long=()
    fi
    lm=(data=text_corpus "data.root=$data/ptb")
    mt=(data=parallel_text "data.root=$data/multi30k")
    for s in ${grid_seeds//,/ }; do
      for preset in ptb_biglstm ptb_biglstm_mixed; do
        run -m "experiment=$preset" "seed=$s" "experiment.seeds=[$plan]" "${lm[@]}" "${common[@]}" hydra.sweep.dir="$W/lm" "$@"
      done
      for preset in multi30k_gnmt multi30k_gnmt_mixed multi30k_gnmt_fp16 \
        multi30k_gnmt_adam multi30k_gnmt_adam_mixed; do
        run -m "experiment=$preset" "seed=$s" "experiment.seeds=[$plan]" "${mt[@]}" "${common[@]}" hydra.sweep.dir="$W/mt" "$@"
      done
    done
    # its own checkpoints, so that a later call could carry it further (they stay on the machine)
    run -m experiment=ptb_biglstm_long "${lm[@]}" "${common[@]/checkpoint=false/checkpoint=true}" "${long[@]}" hydra.sweep.dir="$W/long" "$@" ;;
  classifier)  # the CPU classifier sweep's ResNet-50 presets (scripts/phenomena.sh classifiers), seed 0
    root=$(cifar_root)
    for preset in phenomena/classifiers/3_resnet50 phenomena/classifiers/4_resnet50_static; do
      run -m "experiment=$preset" "data.root=$root" seed=0 hydra.sweep.dir="$W/classifier" "$@"
    done ;;
  cifar | ssd | gnmt | biglstm | dcgan)  # the earlier loans' settings: configs/experiment/gpu/<part>/
    case $part in
    cifar) root=$(cifar_root) ;;
    dcgan)
      mkdir -p /tmp/utk
      tar -xzf "$D/utkface.tar.gz" -C /tmp/utk
      root=$(dirname "$(find /tmp/utk -name '*.jpg' | head -1)") ;;
    ssd) root=$D/raccoon ;;
    gnmt) root=$D/multi30k ;;
    biglstm) root=$D/ptb ;;
    esac
    models=()
    [ "$part" = cifar ] && models=("model=${MODELS:-alexnet,resnet50}")
    for preset in $(cd configs/experiment && ls gpu/"$part"/*.yaml | sed 's/\.yaml$//'); do
      run -m "experiment=$preset" "data.root=$root" "${models[@]}" ${SEEDS:+"seed=$SEEDS"} hydra.sweep.dir="$W/$part" "$@"
    done ;;
  gpt)
    # Beyond the paper: GPT-2's architecture on PTB (ptb_gpt: fp32, bf16, fp8, mxfp8), seed-major,
    # so that a call cut off leaves whole seeds.
    plan=${PLAN:-0,1,2}
    common=(checkpoint=false)
    if [ -n "$dry" ]; then
      data=$(cd ../shared/data && pwd)
      common+=(device=cpu schedule.steps=2 schedule.epochs=null)
    else
      data=$D
      common+=(device=cuda)
    fi
    grid_seeds=${SEEDS:-$plan}
    for s in ${grid_seeds//,/ }; do
      run -m experiment=ptb_gpt "seed=$s" "experiment.seeds=[$plan]" data=text_corpus "data.root=$data/ptb" "${common[@]}" hydra.sweep.dir="$W/gpt" "$@"
    done ;;
  *) echo "device_session.sh: PART=$part: expected one of accuracy, sequences, gpt, speed, suite, arithmetic, bench, options, peer, next, others, classifier, cifar, ssd, gnmt, biglstm, dcgan" >&2; exit 2 ;;
esac
exit $rc
