"""The functions ``megatron.training.pretrain`` calls: model provider, datasets provider, forward step.

They follow Megatron-LM's ``pretrain_gpt.py`` (branch core_r0.19.0) so that a user of Megatron meets the
same batches, loss and log lines; the model is ZAYA1.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from ..checkpoint.fits import tokenizer_identity
from ..config import architecture
from ..ops.lm_head import IGNORE_INDEX
from ..model import build_zaya_model
from .arguments import zaya_config_from_args
from .balancing import finalize_model_grads_with_balancing
from .loss_curve import LOSS_CURVE

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's legacy model-provider hook: the ZAYA1 model of this pipeline stage."""
    args = get_args()
    print_rank_0("building ZAYA1 model ...")
    zaya = zaya_config_from_args(args)
    args.zaya_architecture = architecture(zaya)  # saved with the checkpoint's args; export-hf reads it
    args.zaya_tokenizer = tokenizer_identity(get_tokenizer(), args)  # saved too; a resume checks it
    zaya.finalize_model_grads_func = finalize_model_grads_with_balancing
    return build_zaya_model(zaya, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                            pg_collection=pg_collection)


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, sliced for context parallelism.

    No dense attention mask: the model finds packed documents from the position ids (``model/documents.py``).
    """
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=False,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(key) for key in BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked loss, token count, and the ``lm loss`` report (as ``pretrain_gpt``)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    LOSS_CURVE.add(loss.detach(), num_tokens)
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch forward: per-token losses and the loss function to reduce them."""
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, getattr(model, "vp_stage", None))
    if labels is not None and loss_mask is not None:
        # Masked tokens (--eod-mask-loss, padding) are ignored by the LM head too: the fused head then sees one
        # loss gradient for every token it counts and keeps the gradients it computed in its forward.
        labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    # Position ids mark packed documents (--reset-position-ids --reset-attention-mask); else one causal sequence.
    output = model(tokens, position_ids if get_args().reset_position_ids else None, labels=labels)
    return output, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False,  # [s, s] per sample; the model needs none
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron indexed datasets (``--data-path``, blends) or ``--mock-data``."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for ZAYA1 ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        dataset_config(args),
    ).build()
    # A blend asked for 0 samples of a split (--eval-iters 0) is an empty dataset, which Megatron's sampler
    # refuses ("no sample to consume"); no dataset is what Megatron expects of a split it will not read.
    return [None if dataset is not None and len(dataset) == 0 else dataset for dataset in datasets]


train_valid_test_datasets_provider.is_distributed = True
