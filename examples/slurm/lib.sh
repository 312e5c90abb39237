# shellcheck shell=bash
# Helpers for the sbatch scripts in this folder (sourced, after `set -euo pipefail`).
#
# Reads the variables the scripts' headers explain: ZAYA_REPO (the checkout), ZAYA_PLATFORM, RUN_DIR,
# CONTAINER_RUNTIME (pyxis | apptainer | none), CONTAINER_IMAGE, CONTAINER_MOUNTS, and for training
# MODEL, SEQ_LENGTH, GLOBAL_BATCH, MICRO_BATCH, TRAIN_ITERS, OPTIMIZER, LR, MIN_LR, WARMUP_ITERS,
# SAVE_INTERVAL, WATCHDOG_SECONDS, MAX_RESTARTS, MAX_REQUEUES, DATA_PATH, TOKENIZER, STAGE_ARGS, INIT_FROM,
# EXTRA_ARGS, MASTER_PORT. Sources the launch presets.

# shellcheck source-path=SCRIPTDIR source=../launch/presets.sh
source "$ZAYA_REPO/examples/launch/presets.sh"

zaya_die() {
  echo "error: $*" >&2
  exit 1
}

# zaya_require NAME...: stop with a message naming every variable that is unset or empty.
zaya_require() {
  local name missing=()
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
  done
  if ((${#missing[@]})); then
    zaya_die "set ${missing[*]} before sbatch (the header of this script explains each)"
  fi
}

# zaya_master_addr: the first node of the allocation; torchrun's node rank 0 (SLURM_NODEID 0) runs there.
zaya_master_addr() {
  local hosts # read all of it: `| head -n 1` would break scontrol's pipe under pipefail
  hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
  echo "${hosts%%$'\n'*}"
}

# zaya_mounts PATH...: "p:p,q:q,..." for the existing paths among PATH... (each once, made absolute)
# plus CONTAINER_MOUNTS. A path that does not exist (a hub model name, a data prefix) contributes
# its parent directory if that exists.
zaya_mounts() {
  local path mounts=() seen=" "
  for path in "$@"; do
    [[ -e $path ]] || path=$(dirname "$path")
    [[ -e $path ]] || continue
    path=$(realpath "$path")
    if [[ $seen != *" $path "* ]]; then
      seen+="$path "
      mounts+=("$path:$path")
    fi
  done
  [[ -z "${CONTAINER_MOUNTS:-}" ]] || mounts+=("$CONTAINER_MOUNTS")
  local IFS=,
  echo "${mounts[*]}"
}

# zaya_input_files: set the array ZAYA_INPUT_FILES to the files the glob INPUTS matches, in the same
# (C-locale) order everywhere, so array task i of preprocess_data.sbatch is file i here too.
# shellcheck disable=SC2034  # ZAYA_INPUT_FILES is this function's output
zaya_input_files() {
  local matches
  shopt -s nullglob
  # shellcheck disable=SC2206  # INPUTS is a glob to expand
  matches=($INPUTS)
  shopt -u nullglob
  ((${#matches[@]})) || zaya_die "INPUTS='$INPUTS' matches no file"
  mapfile -t ZAYA_INPUT_FILES < <(printf '%s\n' "${matches[@]}" | LC_ALL=C sort)
}

# zaya_output_prefix FILE: the .bin/.idx prefix zaya-preprocess writes FILE to:
# OUTPUT_DIR/<file name without .gz and its extension>.
zaya_output_prefix() {
  local name
  name=$(basename "$1")
  name=${name%.gz}
  echo "$OUTPUT_DIR/${name%.*}"
}

# zaya_srun_prefix "PATH..." SRUN_OPTION...: set the array ZAYA_SRUN to the srun command, with the
# container around it, to which the caller appends the command to run in it. The container sees
# ZAYA_REPO, the submission directory (its working directory, so relative paths mean what they
# mean here), RUN_DIR and the space-separated host PATHs at their own paths, and not your home
# directory (a ~/.local site-packages there could shadow the image's packages).
# SRUN_OPTIONs take the --name=value form.
# shellcheck disable=SC2034  # ZAYA_SRUN is this function's output
zaya_srun_prefix() {
  local paths mounts
  read -r -a paths <<<"$1"
  shift
  mounts=$(zaya_mounts "$ZAYA_REPO" "$PWD" "$RUN_DIR" "${paths[@]}")
  case "${CONTAINER_RUNTIME:-pyxis}" in
    pyxis)
      zaya_require CONTAINER_IMAGE
      ZAYA_SRUN=(srun "$@" --container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
        --container-workdir="$PWD" --no-container-mount-home)
      ;;
    apptainer)
      zaya_require CONTAINER_IMAGE
      local gpu_flag=--nv
      [[ $ZAYA_PLATFORM != mi* ]] || gpu_flag=--rocm
      ZAYA_SRUN=(srun "$@" apptainer exec "$gpu_flag" --no-home --bind="$mounts" --pwd="$PWD"
        "$CONTAINER_IMAGE")
      ;;
    none) ZAYA_SRUN=(srun "$@") ;;
    *) zaya_die "CONTAINER_RUNTIME='$CONTAINER_RUNTIME' must be pyxis, apptainer or none" ;;
  esac
}

# zaya_run_requeueable COMMAND...: run a training step so that a time-limit warning
# (#SBATCH --signal=B:USR1@...) or a pre-emption SIGTERM stops it cleanly and requeues the job.
# On either signal: SIGTERM to the step (srun passes it to zaya-torchrun, zaya-torchrun to the ranks;
# Megatron's --exit-signal-handler saves a checkpoint, and the step exits 0), wait for it, `scontrol requeue`.
# The restarted job resumes from that checkpoint. Returns the step's exit status otherwise.
zaya_run_requeueable() {
  trap _zaya_stop_and_requeue USR1 TERM
  "$@" &
  _zaya_step_pid=$!
  local status=0
  # wait returns early when a trapped signal arrives; the trap handler then exits the script.
  wait "$_zaya_step_pid" || status=$?
  trap - USR1 TERM
  return "$status"
}

_zaya_stop_and_requeue() {
  trap '' USR1 TERM # Slurm may signal again while the checkpoint is written
  echo "$(date -Is) signal received: stopping the training step at its next checkpoint" >&2
  kill -TERM "$_zaya_step_pid" 2>/dev/null || true
  wait "$_zaya_step_pid" || true
  echo "$(date -Is) requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint" >&2
  scontrol requeue "$SLURM_JOB_ID" || echo "warning: scontrol requeue failed; resubmit this job" >&2
  exit 0
}

# zaya_excluded_nodes LEDGER: the nodes that the event ledger LEDGER (<save>/events.jsonl) records as
# excluded (their self-test failed), with the nodes the job already excludes, comma-separated.
zaya_excluded_nodes() {
  local recorded=() current
  if [[ -f $1 ]]; then
    mapfile -t recorded < <(grep '"event": "node_excluded"' "$1" | sed -n 's/.*"node": "\([^"]*\)".*/\1/p' || true)
  fi
  current=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' || true)
  current=${current#ExcNodeList=}
  [[ $current != "(null)" ]] || current=
  printf '%s\n' "$current" "${recorded[@]}" | sed '/^$/d' | LC_ALL=C sort -u | paste -sd, -
}

# zaya_requeue_after_failure STATUS SAVE: after a training step that failed on its own with exit STATUS
# (zaya-torchrun has spent its in-job restarts, or a node failed its self-test: exit 6), requeue the job
# without the nodes that the event ledger SAVE/events.jsonl records as excluded, at most MAX_REQUEUES
# times (default 3) in a row without a new checkpoint in SAVE (counted in $RUN_DIR/logs/failure-requeues).
# Bad input (exit 2: a flag, the data or a checkpoint refused in one line) and a crash loop (exit 5: the
# same step failed --zaya-max-step-failures times) are not requeued: they need a person. Exits.
zaya_requeue_after_failure() {
  local status=$1 save=$2 count=0 at="" latest="" nodes count_file=$RUN_DIR/logs/failure-requeues
  local ledger=$save/events.jsonl
  [[ ! -f $save/latest_checkpointed_iteration.txt ]] || latest=$(<"$save/latest_checkpointed_iteration.txt")
  [[ ! -f $count_file ]] || read -r count at <"$count_file"
  [[ $at == "$latest" ]] || count=0 # the run progressed since the last requeue on failure
  if ((status == 2)); then
    echo "$(date -Is) the training step refused its input (exit 2, the error line above): not requeued" >&2
    exit "$status"
  fi
  if ((status == 5)); then
    echo "$(date -Is) the training step stopped on a crash loop (exit 5, see $ledger): not requeued" >&2
    exit "$status"
  fi
  if ((count >= ${MAX_REQUEUES:-3})); then
    echo "$(date -Is) the training step failed (exit $status) after $count requeues on failure without a" \
      "new checkpoint (MAX_REQUEUES=${MAX_REQUEUES:-3}): not requeued" >&2
    exit "$status"
  fi
  echo "$((count + 1)) $latest" >"$count_file"
  nodes=$(zaya_excluded_nodes "$ledger")
  if [[ -n $nodes ]]; then
    echo "$(date -Is) excluding nodes $nodes (failed their self-test, see $ledger)" >&2
    scontrol update JobId="$SLURM_JOB_ID" ExcludeNodeList="$nodes" ||
      echo "warning: scontrol update ExcludeNodeList failed; the requeued job may get the same nodes" >&2
  fi
  echo "$(date -Is) the training step failed (exit $status): requeueing job $SLURM_JOB_ID" \
    "($((count + 1)) of ${MAX_REQUEUES:-3} requeues on failure); it resumes from the latest checkpoint" >&2
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "warning: scontrol requeue failed; resubmit this job" >&2
    exit "$status"
  fi
  exit 0
}

# zaya_train_args: set the array ZAYA_TRAIN_ARGS to the zaya-pretrain flags shared by the training
# jobs (everything but --load), from the variables above; checkpoints go to $RUN_DIR/checkpoints.
# Also sets ZAYA_DATA_PREFIXES, the --data-path words.
# shellcheck disable=SC2034  # both arrays are this function's output
zaya_train_args() {
  local extra_args stage_args memory_args=()
  read -r -a ZAYA_DATA_PREFIXES <<<"$DATA_PATH"
  read -r -a stage_args <<<"${STAGE_ARGS:-}"
  read -r -a extra_args <<<"${EXTRA_ARGS:-}"
  if [[ $MODEL == zaya1-8b || $MODEL == zaya1-base ]]; then
    memory_args=("${ZAYA_8B_MEMORY_ARGS[@]}")
  fi
  ZAYA_TRAIN_ARGS=(
    --zaya-preset "$MODEL"
    --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --optimizer "$OPTIMIZER"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --data-path "${ZAYA_DATA_PREFIXES[@]}"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER"
    --save "$RUN_DIR/checkpoints"
    --ckpt-format torch_dist
    --save-interval "$SAVE_INTERVAL"
    --exit-signal-handler
    --zaya-watchdog-seconds "${WATCHDOG_SECONDS:-300}"
    --log-interval 10
    --log-throughput
    --tensorboard-dir "$RUN_DIR/tensorboard"
    --eval-interval 1000
    --eval-iters 10
    "${memory_args[@]}"
    "${stage_args[@]}"
    "${extra_args[@]}"
  )
}

# zaya_load_dir: the --load of a training job: its own checkpoints once it has written one (a requeued
# job resumes), before that INIT_FROM (the previous stage's checkpoints) where it is set.
zaya_load_dir() {
  local own=$RUN_DIR/checkpoints
  if [[ -n "${INIT_FROM:-}" && ! -f $own/latest_checkpointed_iteration.txt ]]; then
    echo "$INIT_FROM"
  else
    echo "$own"
  fi
}

# zaya_launch_training "PATH..." ZAYA_PRETRAIN_ARGS...: run zaya-pretrain on every node of the job
# (torchrun through node_launch.sh, one task per node, MAX_RESTARTS in-job restarts) with requeue on
# pre-emption or time limit, and on failure (zaya_requeue_after_failure).
# PATHs are host paths the container must see besides ZAYA_REPO and RUN_DIR.
zaya_launch_training() {
  local mount_paths=$1 save="" arg previous=""
  shift
  for arg in "$@"; do
    [[ $previous != --save ]] || save=$arg
    previous=$arg
  done
  MASTER_ADDR=$(zaya_master_addr)
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
  export MASTER_ADDR MASTER_PORT
  local logs=$RUN_DIR/logs restart=${SLURM_RESTART_COUNT:-0}
  mkdir -p "$logs" "$RUN_DIR/checkpoints"
  # One task per node owning all of the node's CPUs (a default step could get one core for 8 ranks).
  zaya_srun_prefix "$mount_paths" --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
    --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \
    --output="$logs/train-%j-restart$restart-node%n.log"
  echo "$(date -Is) job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES nodes x $GPUS_PER_NODE GPUs," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, restart $restart, logs in $logs"
  local status=0
  zaya_run_requeueable "${ZAYA_SRUN[@]}" bash "$ZAYA_REPO/examples/slurm/node_launch.sh" \
    zaya-pretrain "$@" || status=$?
  ((status == 0)) || zaya_requeue_after_failure "$status" "$save"
}
