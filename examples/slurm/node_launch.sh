#!/usr/bin/env bash
# One node of a multi-node job: load the launch presets, check the install, start zaya-torchrun
# (torchrun, exiting 0 after a pre-emption that every rank saved).
#
#   srun --ntasks-per-node=1 ... examples/slurm/node_launch.sh zaya-pretrain --zaya-preset zaya1-8b ...
#
# Started once per node by the sbatch scripts in this folder (inside the container when there is
# one). Runs `zaya-torchrun --no-python COMMAND ARGS...` with GPUS_PER_NODE processes, restarting
# them up to MAX_RESTARTS times (default 3) after a failure or a hang (--zaya-watchdog-seconds).
# Reads:
#   ZAYA_PLATFORM            platform presets (examples/launch/presets.sh)
#   MASTER_ADDR, MASTER_PORT rendezvous host and port (exported by the batch script)
#   SLURM_NODEID             this node's rank, 0 on MASTER_ADDR (set by srun)
#   SLURM_JOB_NUM_NODES      number of nodes (set by Slurm)
set -euo pipefail
launch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../launch" && pwd)
# shellcheck source-path=SCRIPTDIR source=../launch/presets.sh
source "$launch_dir/presets.sh"

: "${MASTER_ADDR:?set by the batch script from scontrol show hostnames}"
: "${MASTER_PORT:?set by the batch script}"
node_rank=${SLURM_NODEID:?run this through srun}
nnodes=${SLURM_JOB_NUM_NODES:?run this inside a Slurm job}

# A PYTHONPATH carried into the container can shadow the pinned megatron-core: stop before training.
python3 "$launch_dir/check_install.py"
if [[ $node_rank == 0 ]]; then
  echo "node 0 of $nnodes on $(hostname), rendezvous $MASTER_ADDR:$MASTER_PORT, environment:"
  zaya_print_env
fi

exec zaya-torchrun --nnodes="$nnodes" --nproc-per-node="$GPUS_PER_NODE" --node-rank="$node_rank" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --max-restarts="${MAX_RESTARTS:-3}" \
  --no-python "$@"
