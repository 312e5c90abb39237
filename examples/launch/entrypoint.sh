#!/usr/bin/env bash
# Entrypoint of the megatron-zaya image (Dockerfile.rocm): load the launch presets for
# $ZAYA_PLATFORM (the image defaults to mi300x), then run the given command with them.
#   docker run ... -e ZAYA_PLATFORM=mi355x megatron-zaya:rocm zaya-torchrun --nproc-per-node=8 ...
# Under Slurm (srun + pyxis/apptainer) no entrypoint runs; examples/slurm/node_launch.sh sources
# the same presets.sh instead.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=presets.sh
source "$(dirname "${BASH_SOURCE[0]}")/presets.sh"
exec "$@"
