"""``--optimizer zaya_muon`` in Megatron-Core: ZayaMuon for the matrices, AdamW for everything else.

``get_zaya_muon_optimizer`` has the signature of Megatron's ``get_megatron_optimizer`` and returns a
``ChainedOptimizer`` of (ZayaMuon, AdamW) for dense parameters and the same pair for expert-parallel ones,
so Megatron's LR / WD schedule, gradient clipping (one global norm), bf16 master weights and checkpointing
work unchanged:

* ZayaMuon runs inside Megatron's ``Float16OptimizerWithFloat16Params`` (bf16) or ``FP32Optimizer``, which
  keep fp32 master weights; subclasses only add the owner-only momentum to ``torch_dist`` checkpoints.
* AdamW goes through Megatron's own factory (``_get_megatron_optimizer_based_on_param_groups``).
* Newton–Schulz and momentum are sharded over the data-parallel group (dense: DP×CP; experts: expert-DP),
  which needs full gradients on every rank, i.e. DDP's gradient all-reduce (no ``--use-distributed-optimizer``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import defaultdict
from itertools import chain

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
import megatron.core.optimizer as megatron_optimizer
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import log_single_rank

from .args import OPTIMIZER_NAME, muon_config_from_args
from .muon import MuonConfig, ZayaMuon
from .plan import WorkItem
from .roles import MUON, classify_named_parameters, grouping_table

logger = logging.getLogger(__name__)
MOMENTUM_KEY_PREFIX = "optimizer.state.zaya_muon_momentum"


def get_zaya_muon_optimizer(
    config,
    model_chunks: list,
    config_overrides=None,
    use_gloo_process_groups: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
    dump_param_to_param_group_map: str | None = None,
    *,
    muon_config: MuonConfig | None = None,
) -> ChainedOptimizer:
    """Megatron's optimizer for ``model_chunks`` (DDP-wrapped) with ZayaMuon on the matrices.

    ``muon_config`` defaults to the ``--zaya-muon-*`` flags of Megatron's global arguments.
    ``use_gloo_process_groups`` and ``dump_param_to_param_group_map`` are accepted for signature
    compatibility and unused.
    """
    _check_supported(config, model_chunks)
    if muon_config is None:
        from megatron.training.global_vars import get_args

        args = get_args()
        if args.ckpt_format != "torch_dist":
            raise ValueError("--optimizer zaya_muon saves its data-parallel-sharded momentum with --ckpt-format "
                             f"torch_dist only, got --ckpt-format {args.ckpt_format}")
        muon_config = muon_config_from_args(args)
    pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    roles = classify_named_parameters(
        chain.from_iterable(chunk.named_parameters() for chunk in model_chunks),
        split_gate_up=muon_config.split_gate_up,
    )
    log_single_rank(logger, logging.INFO, grouping_table(roles))
    layouts = {param: role.layout for param, (_, role) in roles.items() if role.optimizer == MUON}

    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    groups = _get_param_groups(model_chunks, config, config_overrides)
    optimizers = []
    for expert in (False, True):
        part = [group for group in groups if group["is_expert_parallel"] == expert]
        if not part:
            continue
        stats_group = pg.tp_ep_pp if expert else pg.mp
        muon = ZayaMuon(
            [{**group, "params": [p for p in group["params"] if p in layouts]} for group in part],
            lr=config.lr, weight_decay=config.weight_decay, config=muon_config, layouts=layouts,
            dp_group=pg.expt_dp if expert else pg.dp_cp, tp_group=pg.tp, expert_tp_group=pg.expt_tp,
        )  # fmt: skip
        optimizers.append(_wrap_muon(muon, config, stats_group, pg))
        adamw_groups = [{**group, "params": [p for p in group["params"] if p not in layouts]} for group in part]
        optimizers.append(_adamw(config, model_chunks, adamw_groups, stats_group, pg))
        log_single_rank(logger, logging.INFO, _work_summary(muon, "expert" if expert else "dense"))
    return ChainedOptimizer(optimizers)


def _check_supported(config, model_chunks) -> None:
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if config.fp16:
        raise ValueError("--optimizer zaya_muon supports bf16 or fp32 training, not --fp16")
    if config.optimizer_cpu_offload or config.use_precision_aware_optimizer or config.optimizer_cuda_graph:
        raise ValueError("--optimizer zaya_muon does not support --optimizer-cpu-offload, "
                         "--use-precision-aware-optimizer or --optimizer-cuda-graph; drop them")
    if ddp_config is not None and (ddp_config.use_distributed_optimizer or ddp_config.use_megatron_fsdp):
        raise ValueError(
            "--optimizer zaya_muon needs DDP's gradient all-reduce, but the model was wrapped for a sharded "
            "optimizer; drop --use-megatron-fsdp, and apply the optim patches (they make --use-distributed-optimizer "
            "mean ZayaMuon's own data-parallel sharding)"
        )


def _wrap_muon(muon: ZayaMuon, config, stats_group, pg):
    init_state_fn = lambda optimizer, config=None: optimizer.init_state()  # noqa: E731
    if config.bf16:
        wrapped = ZayaMuonFloat16Optimizer(muon, config, None, init_state_fn)
    else:
        wrapped = ZayaMuonFP32Optimizer(muon, config, init_state_fn)
    wrapped.grad_stats_parallel_group = stats_group
    wrapped.tp_group, wrapped.expert_tp_group = pg.tp, pg.expt_tp
    return wrapped


def _adamw(config, model_chunks, groups, stats_group, pg):
    adam_config = copy.copy(config)
    adam_config.optimizer, adam_config.use_distributed_optimizer = "adam", False
    optimizer = megatron_optimizer._get_megatron_optimizer_based_on_param_groups(  # patched: optim.fused_torch_adam
        config=adam_config, model_chunks=model_chunks, param_groups=groups,
        model_parallel_group=stats_group, pg_collection=pg,
    )  # fmt: skip
    optimizer.config = config  # ChainedOptimizer requires one config across its members
    return optimizer


def _work_summary(muon: ZayaMuon, kind: str) -> str:
    steps = len(muon.config.coefficients)
    per_rank = [0.0] * muon.dp_size
    for item in muon.items:
        per_rank[item.owner] += item.flops(steps)
    total = sum(per_rank)
    return (
        f"ZayaMuon {kind}: {len(muon.items)} Newton–Schulz items, {total / 1e9:.2f} GFLOP per step, over "
        f"{muon.dp_size} data-parallel rank(s): max {max(per_rank) / 1e9:.2f} GFLOP/rank "
        f"(ideal {total / muon.dp_size / 1e9:.2f})"
    )


class _MomentumCheckpointing:
    """Mixin for Megatron's optimizer wrappers: ZayaMuon's momentum in ``torch_dist`` checkpoints.

    Each owned item's momentum is a ShardedTensor keyed by its model parameter and written by its owner
    (the data-parallel part of the replica id is 0 there; other ranks do not hold it). A whole parameter
    reuses the parameter's sharding (TP / expert axes, SwiGLU factory); one slice of a 3-D parameter is
    an extra leading-axis fragment. The layout does not depend on the parallel sizes, so checkpoints reshard.
    """

    def _model_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _torch_state_section(self, sharded: dict) -> dict:
        raise NotImplementedError

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        muon: ZayaMuon = self.optimizer
        muon.init_state()  # also saved before the first step, so that loading always finds every key
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self._model_params())
        momentum = momentum_sharded_state(muon, id_to_sharded)
        state, muon.state = muon.state, defaultdict(dict)
        try:  # Megatron's conversion of everything else (master weights, param groups), without the momentum
            sharded = super().sharded_state_dict(model_sharded_state_dict, is_loading=False, metadata=metadata)
        finally:
            muon.state = state
        self._torch_state_section(sharded)["state"] = momentum
        return sharded


class ZayaMuonFloat16Optimizer(_MomentumCheckpointing, Float16OptimizerWithFloat16Params):
    """bf16 training: fp32 master weights (Megatron's) + ZayaMuon.

    Its master weights are saved as ``{group index: [tensors]}`` rather than a list of lists: a group
    with no Muon parameter (Megatron's no-weight-decay group, say) is an empty list, which
    ``dist_checkpointing`` drops from a list of lists, shifting the others at load time.
    """

    def _model_params(self):
        return list(chain.from_iterable(self.float16_groups))

    def _torch_state_section(self, sharded):
        return sharded["optimizer"]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        sharded = super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)
        groups = sharded["fp32_from_fp16_params"]
        sharded["fp32_from_fp16_params"] = {i: g if g else LocalNonpersistentObject(g) for i, g in enumerate(groups)}
        return sharded

    def load_state_dict(self, state_dict):
        groups = state_dict["fp32_from_fp16_params"]
        if isinstance(groups, dict):
            state_dict["fp32_from_fp16_params"] = [groups[i] for i in sorted(groups)]
        super().load_state_dict(state_dict)


class ZayaMuonFP32Optimizer(_MomentumCheckpointing, FP32Optimizer):
    """fp32 training: ZayaMuon on the model's own parameters."""

    def _model_params(self):
        return self.get_parameters()

    def _torch_state_section(self, sharded):
        return sharded


def momentum_sharded_state(muon: ZayaMuon, id_to_sharded: dict) -> dict:
    """``{param id: {'momentum': {slice: ShardedTensor}}}`` for this rank's items (ids as in ``state_dict``)."""
    param_id = {}
    for g, group in enumerate(muon.param_groups):
        for i in range(len(group["params"])):
            param_id[(g, i)] = len(param_id)
    sharded: dict = {}
    for item in muon.owned:
        pid = param_id[(item.group, item.index)]
        model_sh = id_to_sharded[pid]
        data = muon.state[muon._param(item)]["momentum"][item.slice_index]
        entry = sharded.setdefault(pid, {"momentum": {}})
        entry["momentum"][item.slice_index] = _momentum_shard(model_sh, data, item, muon._param(item).dim() == 3)
    return sharded


def _momentum_shard(model_sh, data: torch.Tensor, item: WorkItem, is_slice: bool):
    key = f"{MOMENTUM_KEY_PREFIX}.{model_sh.key}"
    rid = model_sh.replica_id
    replica_id = 0 if isinstance(rid, int) else (*rid[:-1], 0)  # the owner writes; DP is the last component
    if not is_slice:
        extra = {} if isinstance(model_sh, ShardedTensorFactory) else {"dtype": data.dtype}
        return dataclasses.replace(model_sh, key=key, data=data, replica_id=replica_id, **extra)
    if not isinstance(model_sh, ShardedTensor):
        raise ValueError(f"ZayaMuon: per-slice momentum of {model_sh.key} needs a plain ShardedTensor, "
                         f"got {type(model_sh).__name__}")
    axis = model_sh.prepend_axis_num  # the slice axis becomes one more prepended (size-1) axis
    offset, fragments = list(model_sh.global_offset), list(model_sh.axis_fragmentations)
    offset[axis] += item.slice_index
    fragments[axis] = model_sh.global_shape[axis]
    return ShardedTensor(
        key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape), global_shape=model_sh.global_shape,
        global_offset=tuple(offset), axis_fragmentations=tuple(fragments), replica_id=replica_id,
        prepend_axis_num=axis + 1,
    )  # fmt: skip


def fuse_torch_adam(optimizer) -> bool:
    """Switch the torch Adam/AdamW inside a Megatron optimizer to torch's fused kernel, before its first step.

    Returns whether it did: not for other optimizers (TE/apex FusedAdam, SGD, ...), an Adam that has stepped,
    or parameters the fused kernel does not take (non-float, or devices other than one CUDA/ROCm or CPU).
    """
    inner = getattr(optimizer, "optimizer", None)
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or any("step" in s for s in inner.state.values()):
        return False
    params = [p for group in inner.param_groups for p in group["params"]]
    if not params or not all(p.is_floating_point() for p in params) or len({p.device for p in params}) != 1:
        return False
    for group in [*inner.param_groups, inner.defaults]:
        group.update(fused=True, foreach=False)
    inner._step_supports_amp_scaling = True  # as torch's constructor sets it with fused=True
    return True


def wrap_get_optimizer_based_on_param_groups(original):
    """Megatron's optimizer factory with :func:`fuse_torch_adam` applied to what it returns."""

    def get_optimizer_based_on_param_groups(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        if isinstance(optimizer, tuple):  # skip_megatron_wrapping=True: (torch optimizer, init_state_fn)
            return optimizer
        fuse_torch_adam(optimizer)
        return optimizer

    get_optimizer_based_on_param_groups.__wrapped__ = original
    return get_optimizer_based_on_param_groups


def wrap_get_megatron_optimizer(original):
    """``get_megatron_optimizer`` that builds ZayaMuon for ``--optimizer zaya_muon`` and defers otherwise."""

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        if config.optimizer != OPTIMIZER_NAME:
            return original(config, model_chunks, *args, **kwargs)
        return get_zaya_muon_optimizer(config, model_chunks, *args, **kwargs)

    get_megatron_optimizer.__wrapped__ = original
    return get_megatron_optimizer
