# shellcheck shell=bash
# Launch presets: the ONE place that holds the per-platform environment and flags of megatron-zaya.
#
#   ZAYA_PLATFORM=mi300x source examples/launch/presets.sh      # mi300x | mi355x | h100 | h200
#
# Sourced by the image's entrypoint (Dockerfile.rocm), examples/pretrain.sh, the Slurm jobs
# (examples/slurm/lib.sh) and, on every node, examples/slurm/node_launch.sh, so a container, a
# one-node run and a Slurm job all get the same settings. A variable is set here only when it is
# unset or empty: anything you export first wins.
#
# Besides the environment below, it sets GPUS_PER_NODE (torchrun processes per node, default 8) and
# these shell variables (not exported):
#   ZAYA_GPU_MEMORY_GIB  memory of one GPU of the platform
#   ZAYA_8B_MICRO_BATCH  starting micro-batch for zaya1-8b / zaya1-base at sequence length 4096
#   ZAYA_8B_MEMORY_ARGS  array: flags zaya1-8b / zaya1-base need on top to fit (recompute on H100)
#   ZAYA_ENV_VARS        array: the variables this file manages; `zaya_print_env` prints them
#
# Memory behind the 8B numbers (estimates, not measurements; lower the micro-batch on OOM):
#   8.84e9 parameters, data parallel over N GPUs with the distributed optimizer (ZeRO-1):
#   bf16 weights 17.7 GB + fp32 grads 35.4 GB + fp32 master weights and Adam moments 106 GB / N
#   = 66 GB at N = 8, 54 GB at N = 128. Activations per micro-batch of one 4096-token sequence:
#   ~10 GB for 40 blocks + 8.6 GB for the fp32 logits and their gradient (4096 x 262272 x 4 B x 2).
#   H100 80 GB: 66 + 19 does not fit, so full recompute (~10 GB of activations, tight on one node;
#   it needs ZayaTransformerBlock to honour Megatron's --recompute-* flags, which it did not yet);
#   H200 141 GB: 2 -> ~104 GB; MI300X 192 GB: 4 -> ~142 GB; MI355X 288 GB: 8 -> ~218 GB.
#
# GEMM tuning on ROCm (hipBLASLt offline tuning), opt-in:
#   ZAYA_GEMM_TUNING=record ZAYA_GEMM_TUNING_FILE=f   a short run writes the best kernel per GEMM shape to f
#   ZAYA_GEMM_TUNING=use    ZAYA_GEMM_TUNING_FILE=f   later runs use those kernels (f must exist)
# Tuned indices are only valid for the hipBLASLt build and GPU they were recorded on.
#
# NIC selection is site-specific and left to you: export NCCL_SOCKET_IFNAME (e.g. ens50f0) and
# NCCL_IB_HCA (e.g. =mlx5_0,mlx5_1 or the ionic_* devices of AMD Pollara NICs) before launching;
# GLOO_SOCKET_IFNAME follows NCCL_SOCKET_IFNAME unless set.

ZAYA_ENV_VARS=()

# zaya_default NAME VALUE: export NAME=VALUE unless NAME already has a non-empty value.
zaya_default() {
  ZAYA_ENV_VARS+=("$1")
  if [[ -z "${!1:-}" ]]; then
    export "$1=$2"
  fi
}

# zaya_print_env: one NAME=VALUE line per managed variable that is set (for the job log).
zaya_print_env() {
  local name
  for name in "${ZAYA_ENV_VARS[@]}"; do
    if [[ -n "${!name:-}" ]]; then
      echo "$name=${!name}"
    fi
  done
}

zaya_preset_error() {
  echo "error: $*" >&2
  return 1
}

case "${ZAYA_PLATFORM:-}" in
  mi300x | mi355x | h100 | h200) ;;
  *)
    zaya_preset_error "ZAYA_PLATFORM='${ZAYA_PLATFORM:-}' is not a known platform;" \
      "export ZAYA_PLATFORM=mi300x (or mi355x, h100, h200) before launching" || return
    ;;
esac

# --- every platform --------------------------------------------------------------------------
zaya_default GPUS_PER_NODE 8
# One hardware work queue per GPU, so communication kernels run in the order Megatron issues
# them (its tensor/sequence-parallel overlap relies on it and warns without it).
zaya_default CUDA_DEVICE_MAX_CONNECTIONS 1
# Collectives on high-priority streams, so overlapped gradient reduce-scatters and parameter
# all-gathers are not starved by compute kernels.
zaya_default TORCH_NCCL_HIGH_PRIORITY 1
# Log lines reach torchrun/Slurm log files when printed, not when a buffer fills.
zaya_default PYTHONUNBUFFERED 1
# On SIGTERM (pre-emption, Slurm time limit) zaya-torchrun gives the ranks this long to finish the
# checkpoint Megatron's --exit-signal-handler writes, instead of 30 s, before it kills them.
zaya_default TORCH_ELASTIC_SHUTDOWN_TIMEOUT 300
ZAYA_ENV_VARS+=(NCCL_SOCKET_IFNAME NCCL_IB_HCA)
if [[ -n "${NCCL_SOCKET_IFNAME:-}" ]]; then
  zaya_default GLOO_SOCKET_IFNAME "$NCCL_SOCKET_IFNAME"
fi

case "$ZAYA_PLATFORM" in
  mi300x | mi355x)
    # Keep GPU scratch memory allocated: reclaiming it mid-run crashes MoE training with
    # HSA_STATUS_ERROR_OUT_OF_RESOURCES (AMD sets both in its rocm/primus training images).
    zaya_default HSA_NO_SCRATCH_RECLAIM 1
    zaya_default HSA_ENABLE_SCRATCH_ASYNC_RECLAIM 0
    # Two HIP hardware queues per process instead of four: 8 ranks per node otherwise oversubscribe
    # the GPU's hardware queue slots (AMD's Primus default).
    zaya_default GPU_MAX_HW_QUEUES 2
    # Kernel arguments in device memory: lower launch latency for the many small MoE kernels.
    zaya_default HIP_FORCE_DEV_KERNARG 1
    # RoCE v2 over IPv4 is GID index 3 on AMD's reference clusters; use 0 on InfiniBand.
    zaya_default NCCL_IB_GID_INDEX 3
    # Rails-only networks (as in ZAYA1's cluster): a ring stays on the same NIC index across nodes.
    zaya_default NCCL_CROSS_NIC 0
    # RCCL's MSCCL algorithms off, as in AMD's Primus defaults (stability over the last few %).
    zaya_default RCCL_MSCCL_ENABLE 0
    ;;
  h100 | h200)
    # NVLink multicast (NVLS / NVLink SHARP, symmetric-memory multicast) off. On shared hosts, such
    # as the H200 machines this project is tested on, a program using it can take the host's GPUs
    # out of service for a day or more. Turn it on (=1 / =0 below) only on machines you own.
    zaya_default NCCL_NVLS_ENABLE 0
    zaya_default TORCH_SYMM_MEM_DISABLE_MULTICAST 1
    zaya_default NVSHMEM_DISABLE_NVLS 1
    ;;
esac

if [[ $ZAYA_PLATFORM == mi355x ]]; then
  # gfx950: RCCL's WarpSpeed auto-tuning off; AMD's Primus turned it off on MI350/MI355 after NaNs.
  zaya_default RCCL_WARP_SPEED_AUTO 0
fi

# --- GEMM tuning (ROCm only) -------------------------------------------------------------------
case "${ZAYA_GEMM_TUNING:-off}" in
  off) ;;
  record | use)
    if [[ $ZAYA_PLATFORM != mi* ]]; then
      zaya_preset_error "ZAYA_GEMM_TUNING uses hipBLASLt, which is ROCm-only; unset it on $ZAYA_PLATFORM" || return
    fi
    if [[ -z "${ZAYA_GEMM_TUNING_FILE:-}" ]]; then
      zaya_preset_error "ZAYA_GEMM_TUNING=$ZAYA_GEMM_TUNING needs ZAYA_GEMM_TUNING_FILE=<path of the tuning file>" || return
    fi
    if [[ $ZAYA_GEMM_TUNING == record ]]; then
      zaya_default HIPBLASLT_TUNING_FILE "$ZAYA_GEMM_TUNING_FILE"
    elif [[ -f $ZAYA_GEMM_TUNING_FILE ]]; then
      zaya_default HIPBLASLT_TUNING_OVERRIDE_FILE "$ZAYA_GEMM_TUNING_FILE"
    else
      zaya_preset_error "ZAYA_GEMM_TUNING_FILE=$ZAYA_GEMM_TUNING_FILE does not exist;" \
        "record it first with ZAYA_GEMM_TUNING=record" || return
    fi
    ;;
  *)
    zaya_preset_error "ZAYA_GEMM_TUNING='$ZAYA_GEMM_TUNING' must be off, record or use" || return
    ;;
esac

# --- flag presets (memory-driven; see the arithmetic in the header) ------------------------------
# shellcheck disable=SC2034  # read by the scripts that source this file
ZAYA_8B_MEMORY_ARGS=()
# shellcheck disable=SC2034
case "$ZAYA_PLATFORM" in
  mi300x) ZAYA_GPU_MEMORY_GIB=192 ZAYA_8B_MICRO_BATCH=4 ;;
  mi355x) ZAYA_GPU_MEMORY_GIB=288 ZAYA_8B_MICRO_BATCH=8 ;;
  h200) ZAYA_GPU_MEMORY_GIB=141 ZAYA_8B_MICRO_BATCH=2 ;;
  h100)
    ZAYA_GPU_MEMORY_GIB=80 ZAYA_8B_MICRO_BATCH=1
    ZAYA_8B_MEMORY_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
    ;;
esac
