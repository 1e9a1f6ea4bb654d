#!/usr/bin/env bash
# Fill the ignored .whl/ and .data/ that a device call of scripts/device/device_session.sh PART carries
# (64 MiB in all, so each part carries only its own data). Run from the project root, here:
#   scripts/device/device_carry.sh PART
# peer: also needs DLE_GIT, a git directory of NVIDIA/DeepLearningExamples, and DLLOGGER_GIT, one
# of NVIDIA/dllogger (e.g. what the search tool's fetch brought); their files go into .data/peer,
# which git ignores: the peer's code is run on the device, never added to the project.
set -euo pipefail
part=${1:?usage: scripts/device/device_carry.sh PART}
root=$(git rev-parse --show-toplevel)
cd "$root"
shared=${SHARED_DATA:-$root/../shared/data}
rm -rf .data && mkdir -p .data
# peer: DLE imports pynvml (nvidia-ml-py), which the device image has; carried too, to be sure.
../shared/offline/wheels.sh $(case $part in peer) echo nvidia-ml-py ;; esac) > /dev/null
# What the records will name: the commit, whether tracked files differ from it, and a hash of the
# tracked files' content, which device_session.sh recomputes on the copy it runs in. results/ is
# left out of the hash: the records change nothing a run computes, and they can be left behind
# (moved aside here) when the tree would pass the device's 64 MiB.
git ls-files -- . ':!:results' > .data/GIT_FILES
hash=$(tr '\n' '\0' < .data/GIT_FILES | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
echo "$(git rev-parse HEAD) $([ -n "$(git status --porcelain --untracked-files=no -- . ':!:results')" ] && echo 1 || echo 0) $hash" > .data/GIT
case $part in
  suite|arithmetic|bench|options|speed) ;;
  peer)
    mkdir -p .data/peer/ConvNets .data/peer/dllogger
    git --git-dir="${DLE_GIT:?set DLE_GIT}" archive HEAD PyTorch/Classification/ConvNets | tar -x -C .data/peer/ConvNets --strip-components=3
    git --git-dir="${DLLOGGER_GIT:?set DLLOGGER_GIT}" archive HEAD dllogger | tar -x -C .data/peer/dllogger
    git --git-dir="$DLE_GIT" rev-parse HEAD > .data/peer/COMMIT ;;
  accuracy|cifar|classifier|next|others) cp "$shared/cifar10.tar.gz" .data/ ;;  # next and others: one carry for both calls
  ssd) cp -r "$shared/raccoon" .data/ ;;
  gnmt) cp -r "$shared/multi30k" .data/ ;;
  biglstm) cp -r "$shared/ptb" .data/ ;;
  sequences) cp -r "$shared/ptb" "$shared/multi30k" .data/ ;;
  gpt) cp -r "$shared/ptb" .data/ ;;
  dcgan) cp "$shared/utkface.tar.gz" .data/ ;;
  *) echo "device_carry.sh: PART=$part: expected one of accuracy, sequences, gpt, speed, suite, arithmetic, bench, options, peer, next, others, classifier, cifar, ssd, gnmt, biglstm, dcgan" >&2; exit 2 ;;
esac
du -sh .whl .data
