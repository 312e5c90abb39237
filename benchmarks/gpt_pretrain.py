"""Megatron's stock GPT ``pretrain()`` behind the megatron-zaya patches: the GPT-MoE baseline of the benchmarks
(``benchmarks/gpt_entry.py``), and on CPU the check that the patches let Megatron's own training run
(tests/functional/test_cpu_pretrain_gpt.py).

Modelled on Megatron-LM's ``pretrain_gpt.py`` (branch core_r0.19.0), cut down to a mock-data GPT:
the model comes from ``gpt_config_from_args`` (Megatron's own GPTModelBuilder), the data from
``MockGPTDataset``. Launch (CPU, gloo), with the usual Megatron flags:

    python benchmarks/gpt_pretrain.py --distributed-backend gloo --transformer-impl local --mock-data \
        --tokenizer-type NullTokenizer --vocab-size 128 ...            # or torchrun --nproc-per-node 2
"""

from megatron_zaya.patches import apply_patches

apply_patches()  # before anything runs: the cpu group swaps CUDA calls in Megatron modules

import json  # noqa: E402
import os  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
LOSS_RECORD = os.environ.get("GPT_PRETRAIN_LOSSES")  # if set, each rank appends its exact micro-batch losses here


def get_batch(data_iterator):
    """Next micro-batch ``[b, s]`` tensors, read on TP rank 0 and broadcast to the TP group."""
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {key: sample[key].cuda(non_blocking=True) if key in sample else None for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        is_pipeline_first_stage=True,
        is_pipeline_last_stage=True,
    )
    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask, output_tensor):
    """Masked token loss sum, token count, and the ``lm loss`` report Megatron averages over DP."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if LOSS_RECORD:
        record = {"iteration": get_args().curr_iteration + 1, "loss_sum": loss.item(), "tokens": num_tokens.item()}
        with open(f"{LOSS_RECORD}.rank{torch.distributed.get_rank()}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    """Per-token losses ``[b, s]`` of one micro-batch, and the loss function to reduce them."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock GPT datasets of the requested sizes, built on TP rank 0."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()


train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    args = parse_and_validate_args()
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
