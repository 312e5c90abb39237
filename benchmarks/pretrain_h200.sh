#!/usr/bin/env bash
# End-to-end training throughput on one GPU: zaya-pretrain (ZAYA1-8B width, 8 layers) and, in the same run,
# the baseline a Megatron user would otherwise pick: Megatron-Core's stock GPT-MoE at the same width, heads,
# experts and active parameters (GQA attention instead of CCA, Megatron's TopKRouter instead of ZAYA1's).
#
#   bash benchmarks/pretrain_h200.sh [ITERS] [OUT_DIR]
#
# Both use mock data, sequence 4096, micro-batch 2, global batch 8, bf16, Adam, no TE/apex (local spec).
# ZAYA1 runs twice: with the patches that apply on the platform (Triton kernels on a GPU) and with
# --zaya-patches startup (the torch reference paths). Prints Megatron's iteration lines (with TFLOP/s/GPU)
# and a summary of mean iteration time over the iterations after the first 10;
# tokens/s/GPU = 8 * 4096 / iteration time.
set -euo pipefail
ITERS=${1:-50}
OUT=${2:-runs/bench}
mkdir -p "$OUT"
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29555}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

common=(--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 8
        --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5 --lr-decay-style cosine
        --weight-decay 0.1 --clip-grad 1.0 --bf16 --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000
        --mock-data --tokenizer-type NullTokenizer --transformer-impl local --no-gradient-accumulation-fusion)

# ZAYA1 with every patch that applies here (the Triton kernels on a GPU), then with the torch paths only.
python -m megatron_zaya.pretrain --zaya-preset zaya1-8b-shallow --vocab-size 262271 "${common[@]}" \
  2>&1 | tee "$OUT/zaya.log" | grep -E "iteration +[0-9]+/|error|Error" || true
if [ -z "${SKIP_TORCH_PATHS:-}" ]; then  # set SKIP_TORCH_PATHS=1 to time only the kernels and the baseline
  python -m megatron_zaya.pretrain --zaya-preset zaya1-8b-shallow --vocab-size 262271 "${common[@]}" \
    --zaya-patches startup 2>&1 | tee "$OUT/zaya_torch.log" | grep -E "iteration +[0-9]+/|error|Error" || true
fi

python "$here/tests/gpt_cpu_entry.py" --num-layers 8 --hidden-size 2048 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --kv-channels 128 --ffn-hidden-size 2048 \
  --num-experts 16 --moe-ffn-hidden-size 2048 --moe-router-topk 1 --moe-router-pre-softmax \
  --moe-router-load-balancing-type none --moe-token-dispatcher-type alltoall --swiglu \
  --normalization RMSNorm --disable-bias-linear --position-embedding-type rope --rotary-percent 0.5 --no-rope-fusion --no-masked-softmax-fusion \
  --vocab-size 262271 --hidden-dropout 0 --attention-dropout 0 \
  "${common[@]}" 2>&1 | tee "$OUT/gpt_moe.log" | grep -E "iteration +[0-9]+/|error|Error" || true

python - "$OUT" <<'PY'
import re, sys, statistics
out = sys.argv[1]
import os
for name in ("zaya", "zaya_torch", "gpt_moe"):
    if not os.path.exists(f"{out}/{name}.log"):
        continue
    text = open(f"{out}/{name}.log").read()
    rows = re.findall(r"iteration\s+(\d+)/.*?per iteration \(ms\): ([0-9.]+).*?TFLOP/s/GPU\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)", text)
    steady = [(float(ms), float(tf)) for it, ms, tf, _ in rows if int(it) > 10]
    if not steady:
        print(f"{name}: no iterations parsed"); continue
    ms = statistics.mean(m for m, _ in steady); tf = statistics.mean(t for _, t in steady)
    print(f"{name}: {len(rows)} iterations, mean {ms:.1f} ms/iter after 10, {8*4096/ms*1000:.0f} tokens/s/GPU, "
          f"Megatron TFLOP/s/GPU {tf:.1f}, loss {rows[0][3]} -> {rows[-1][3]}")
PY
