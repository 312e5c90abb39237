#!/usr/bin/env bash
# Train ZAYA1 on one machine with zaya-torchrun, on one GPU or on all GPUs of a node.
#
#   ZAYA_PLATFORM=h200 MODEL=tiny bash examples/pretrain.sh
#   ZAYA_PLATFORM=h200 MODEL=zaya1-8b-shallow bash examples/pretrain.sh
#   ZAYA_PLATFORM=mi300x MODEL=zaya1-8b NGPUS=8 bash examples/pretrain.sh
#
# Variables:
#   ZAYA_PLATFORM  mi300x | mi355x | h100 | h200 (required): examples/launch/presets.sh
#   MODEL          tiny (default) | zaya1-8b-shallow | zaya1-8b: the --zaya-preset
#   NGPUS          GPUs to use, 1 (default) to GPUS_PER_NODE
#   RUN_DIR        checkpoints/ and tensorboard/ (default runs/<MODEL> in the current directory);
#                  a second run with the same RUN_DIR resumes from its latest checkpoint
#   DATA_PATH      Megatron data prefix(es) from zaya-preprocess. Unset: tiny trains on the corpus
#                  embedded in megatron-zaya, the others on --mock-data
#   TOKENIZER      Hugging Face tokenizer directory or hub name (unset: zaya-pretrain's default)
#   TRAIN_ITERS, MICRO_BATCH, GLOBAL_BATCH, LR: override the per-model defaults below
#   EXTRA_ARGS     more zaya-pretrain flags, split on spaces
#
# What to expect (parameter counts from the ZAYA1-8B shapes; memory is estimated, not measured):
#   tiny              the preset's own small model and schedule: Megatron's iteration lines with the
#                     lm loss falling within minutes, on any GPU (and on CPU without torchrun).
#   zaya1-8b-shallow  ZAYA1-8B width, 8 of its 40 layers: 1.66B parameters + 0.54B embedding
#                     (0.69B active per token). One GPU holds it: 2.2B x 16 B of weights, grads and
#                     Adam state = 35 GB, plus ~11 GB of activations per 4096-token sequence
#                     (MICRO_BATCH 2 by default). 50 iterations; iteration 1's lm loss is about
#                     ln(262272) = 12.5, then falls; --log-throughput prints TFLOP/s per GPU.
#   zaya1-8b          the full model, 8.84B parameters: 141 GB of weights and optimizer state on one
#                     GPU, so NGPUS=1 (micro-batch 1, ~160 GB) only fits MI300X/MI355X; on a full
#                     node the distributed optimizer brings it to ~66 GB per GPU and the platform
#                     preset picks the micro-batch.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=launch/presets.sh
source "$here/launch/presets.sh"

MODEL=${MODEL:-tiny}
NGPUS=${NGPUS:-1}
RUN_DIR=${RUN_DIR:-runs/$MODEL}
die() {
  echo "error: $*" >&2
  exit 1
}
if ((NGPUS < 1 || NGPUS > GPUS_PER_NODE)); then
  die "NGPUS=$NGPUS must be between 1 and GPUS_PER_NODE=$GPUS_PER_NODE"
fi

model_args=()
case "$MODEL" in
  tiny) ;;
  zaya1-8b-shallow)
    MICRO_BATCH=${MICRO_BATCH:-2}
    ;;
  zaya1-8b)
    if ((NGPUS == 1 && ZAYA_GPU_MEMORY_GIB < 192)); then
      die "zaya1-8b needs ~160 GB on one GPU and $ZAYA_PLATFORM has $ZAYA_GPU_MEMORY_GIB GiB;" \
        "use NGPUS=8 or MODEL=zaya1-8b-shallow"
    fi
    # The preset's micro-batch assumes the optimizer state spread over a full node (66 GB per GPU).
    ((NGPUS == GPUS_PER_NODE)) || MICRO_BATCH=${MICRO_BATCH:-1}
    MICRO_BATCH=${MICRO_BATCH:-$ZAYA_8B_MICRO_BATCH}
    model_args=("${ZAYA_8B_MEMORY_ARGS[@]}")
    ;;
  *) die "MODEL=$MODEL must be tiny, zaya1-8b-shallow or zaya1-8b" ;;
esac
if [[ $MODEL != tiny ]]; then
  TRAIN_ITERS=${TRAIN_ITERS:-50}
  model_args+=(
    --seq-length 4096
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "${GLOBAL_BATCH:-$((MICRO_BATCH * NGPUS))}"
    --train-iters "$TRAIN_ITERS"
    --lr "${LR:-4e-4}"
    --min-lr 4e-5
    --lr-decay-style cosine
    --lr-warmup-iters $((TRAIN_ITERS / 5))
    --bf16
    --use-distributed-optimizer
    --log-interval 1
    --log-throughput
    --save-interval "$TRAIN_ITERS"
  )
  [[ -n "${DATA_PATH:-}" ]] || model_args+=(--mock-data)
fi

data_args=()
if [[ -n "${DATA_PATH:-}" ]]; then
  read -r -a data_prefixes <<<"$DATA_PATH"
  data_args=(--data-path "${data_prefixes[@]}")
fi
if [[ -n "${TOKENIZER:-}" ]]; then
  data_args+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
fi
read -r -a extra_args <<<"${EXTRA_ARGS:-}"

mkdir -p "$RUN_DIR"
zaya_print_env
exec zaya-torchrun --standalone --nproc-per-node="$NGPUS" --no-python zaya-pretrain \
  --zaya-preset "$MODEL" "${model_args[@]}" "${data_args[@]}" \
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --ckpt-format torch_dist \
  --tensorboard-dir "$RUN_DIR/tensorboard" "${extra_args[@]}"
