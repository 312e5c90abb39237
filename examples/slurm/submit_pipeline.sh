#!/usr/bin/env bash
# Submit raw text -> ZAYA1-8B pretraining as two dependent Slurm jobs: preprocess_data.sbatch as an
# array (one task per input file), then pretrain_zaya1_8b.sbatch on all of its outputs, which starts
# only once every array task succeeded (--dependency=afterok).
#
#   ZAYA_PLATFORM=mi300x INPUTS='/shared/raw/*.jsonl' OUTPUT_DIR=/shared/data \
#     TOKENIZER=/shared/models/ZAYA1-8B RUN_DIR=/shared/runs/zaya1-8b \
#     CONTAINER_IMAGE=/shared/images/megatron-zaya+rocm.sqsh \
#     bash examples/slurm/submit_pipeline.sh --nodes=16 --partition=gpu
#
# Arguments go to the pretraining sbatch. Variables: those of preprocess_data.sbatch and
# pretrain_zaya1_8b.sbatch, except DATA_PATH, which this script sets to every output prefix without
# weights (Megatron then samples each file in proportion to its size). Prints the two job ids.
set -euo pipefail
ZAYA_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export ZAYA_REPO # the jobs find their helpers here, wherever sbatch runs from
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ZAYA_REPO/examples/slurm/lib.sh"
zaya_require INPUTS OUTPUT_DIR TOKENIZER RUN_DIR
zaya_input_files

prefixes=()
for input in "${ZAYA_INPUT_FILES[@]}"; do
  prefixes+=("$(zaya_output_prefix "$input")")
done
preprocess=$(sbatch --parsable --array=0-$((${#ZAYA_INPUT_FILES[@]} - 1)) \
  "$ZAYA_REPO/examples/slurm/preprocess_data.sbatch")
preprocess=${preprocess%%;*} # --parsable prints "id;cluster" on multi-cluster sites
pretrain=$(DATA_PATH="${prefixes[*]}" sbatch --parsable --dependency="afterok:$preprocess" "$@" \
  "$ZAYA_REPO/examples/slurm/pretrain_zaya1_8b.sbatch")
echo "preprocessing: job $preprocess (${#ZAYA_INPUT_FILES[@]} array tasks); pretraining: job $pretrain"
