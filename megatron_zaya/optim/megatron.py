"""``--optimizer zaya_muon`` in Megatron-Core: ZayaMuon for the matrices, AdamW for everything else.

``get_zaya_muon_optimizer`` has the signature of Megatron's ``get_megatron_optimizer`` and returns a
``ChainedOptimizer`` of (ZayaMuon, AdamW) for dense parameters and the same pair for expert-parallel ones,
so Megatron's LR / WD schedule, gradient clipping (one global norm), bf16 master weights and checkpointing
work unchanged:

* ZayaMuon runs inside Megatron's ``Float16OptimizerWithFloat16Params`` (bf16) or ``FP32Optimizer``, which
  keep fp32 master weights; subclasses add the owner-only momentum to ``torch_dist`` checkpoints and hand
  ZayaMuon the gradient buffer itself (``_MuonWrapper``).
* AdamW goes through Megatron's own factory (``_get_megatron_optimizer_based_on_param_groups``).
* Without ``--use-distributed-optimizer``, Newton–Schulz and momentum are sharded over the data-parallel group
  (dense: DP×CP; experts: expert-DP), which needs full gradients on every rank, i.e. DDP's gradient all-reduce.
* With it (ZeRO-1, see ``zero``), DDP's buckets are laid out by owner: each rank's ZayaMuon holds, and keeps fp32
  master weights and momentum for, the matrices it owns only; AdamW is Megatron's ``DistributedOptimizer``.

ZayaMuon reads DDP's gradient buffer (fp32 or bf16) matrix by matrix, and gradient clipping reaches it as a
factor (``ZayaMuonChainedOptimizer``), so the Muon half of the step never holds fp32 copies of the gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import defaultdict
from itertools import chain

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
import megatron.core.optimizer as megatron_optimizer
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.utils import get_pg_rank, log_single_rank

from . import zero
from .args import OPTIMIZER_NAME, muon_config_from_args
from .muon import MuonConfig, ZayaMuon, gradient_of
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
    zero1 = _check_supported(config, model_chunks)
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
    owner = zero.owners(model_chunks) if zero1 else {}
    optimizers, sharded_adamw_groups = [], []
    for expert in (False, True):
        part = [group for group in groups if group["is_expert_parallel"] == expert]
        if not part:
            continue
        stats_group = pg.tp_ep_pp if expert else pg.mp
        dp_group = pg.expt_dp if expert else pg.dp_cp
        if zero1:  # this rank's matrices only; the reduce-scatter and all-gather are DDP's
            dp_rank = get_pg_rank(dp_group)
            mine = lambda p: p in layouts and owner[p] == dp_rank  # noqa: E731
        else:
            mine = lambda p: p in layouts  # noqa: E731
        muon = ZayaMuon(
            [{**group, "params": [p for p in group["params"] if mine(p)]} for group in part],
            lr=config.lr, weight_decay=config.weight_decay, config=muon_config, layouts=layouts,
            dp_group=None if zero1 else dp_group, tp_group=pg.tp, expert_tp_group=pg.expt_tp,
        )  # fmt: skip
        optimizers.append(_wrap_muon(muon, config, stats_group, pg, zero1))
        adamw_groups = [{**group, "params": [p for p in group["params"] if p not in layouts]} for group in part]
        if zero1:
            if expert and any(group["params"] for group in adamw_groups):
                raise ValueError("--optimizer zaya_muon --use-distributed-optimizer does not shard AdamW parameters of "
                                 "experts (biases or norms inside experts); drop --use-distributed-optimizer")
            sharded_adamw_groups += [group for group in adamw_groups if group["params"]]
        else:
            optimizers.append(_adamw(config, model_chunks, adamw_groups, stats_group, pg))
        kind = "expert" if expert else "dense"
        log_single_rank(logger, logging.INFO, _zero1_summary(owner, layouts, dp_group, kind) if zero1
                        else _work_summary(muon, kind))  # fmt: skip
    if zero1:
        adamw = _distributed_adamw(config, model_chunks, sharded_adamw_groups, pg)
        for wrapped in optimizers:  # one global norm over every rank's shards, as the distributed optimizer's
            wrapped.grad_stats_parallel_group = adamw.get_grad_stats_parallel_group()
        optimizers.append(adamw)
    return ZayaMuonChainedOptimizer(optimizers, model_chunks if zero1 else [])


def _check_supported(config, model_chunks) -> bool:
    """Refuse what ZayaMuon cannot run; return whether the model was wrapped for ZeRO-1 (``zero``)."""
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if config.fp16:
        raise ValueError("--optimizer zaya_muon supports bf16 or fp32 training, not --fp16")
    if config.optimizer_cpu_offload or config.use_precision_aware_optimizer or config.optimizer_cuda_graph:
        raise ValueError("--optimizer zaya_muon does not support --optimizer-cpu-offload, "
                         "--use-precision-aware-optimizer or --optimizer-cuda-graph; drop them")
    if ddp_config is None or not (ddp_config.use_distributed_optimizer or ddp_config.use_megatron_fsdp):
        return False
    if ddp_config.use_megatron_fsdp:
        raise ValueError("--optimizer zaya_muon does not support --use-megatron-fsdp; use --use-distributed-optimizer")
    if not zero.is_tagged(p for chunk in model_chunks for p in chunk.parameters()):
        raise ValueError(
            "--optimizer zaya_muon with --use-distributed-optimizer needs DDP buffers laid out by matrix owner; apply "
            "the optim patches (or wrap the model with megatron_zaya.optim.zero.tag_muon_params and "
            "compute_full_param_layout)"
        )
    if config.overlap_param_gather_with_optimizer_step:
        raise ValueError("--optimizer zaya_muon does not support --overlap-param-gather-with-optimizer-step; use "
                         "--overlap-param-gather")
    if ddp_config.num_distributed_optimizer_instances != 1:
        raise ValueError("--optimizer zaya_muon --use-distributed-optimizer supports one distributed-optimizer "
                         "instance; drop --num-distributed-optimizer-instances")
    return True


def _wrap_muon(muon: ZayaMuon, config, stats_group, pg, zero1: bool):
    init_state_fn = lambda optimizer, config=None: optimizer.init_state()  # noqa: E731
    if config.bf16:
        wrapped = ZayaMuonFloat16Optimizer(muon, config, None, init_state_fn)
    else:
        wrapped = ZayaMuonFP32Optimizer(muon, config, init_state_fn)
    wrapped.grad_stats_parallel_group = stats_group
    wrapped.tp_group, wrapped.expert_tp_group = pg.tp, pg.expt_tp
    wrapped.zero1 = zero1
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


def _distributed_adamw(config, model_chunks, groups, pg):
    """Megatron's ``DistributedOptimizer`` (AdamW) over the byte-level buffers, as Megatron builds it beside its
    own layer-wise optimizer."""
    adam_config = copy.copy(config)
    adam_config.optimizer, adam_config.use_distributed_optimizer = "adam", True
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(pg, model_chunks, use_gloo_process_groups=False)
    buffers = {i: [b for b in chunk.buffers if b.params and not b.params[0].is_managed_by_layer_wise_optimizer]
               for i, chunk in enumerate(model_chunks)}
    optimizer = megatron_optimizer._get_megatron_optimizer_based_on_param_groups(
        config=adam_config, model_chunks=model_chunks, param_groups=groups,
        per_model_buffers={i: b for i, b in buffers.items() if b}, model_parallel_group=pgs["mp_group"],
        data_parallel_group=pgs["intra_dp_cp_group"], data_parallel_group_gloo=pgs["intra_dp_cp_group_gloo"],
        data_parallel_group_idx=get_pg_rank(pgs["mp_group"]), intra_dist_opt_group=pgs["intra_dist_opt_group"],
        distributed_optimizer_instance_id=0, pg_collection=pg,
    )  # fmt: skip
    optimizer.config = config
    return optimizer


def _zero1_summary(owner: dict, layouts: dict, dp_group, kind: str) -> str:
    size = torch.distributed.get_world_size(dp_group) if dp_group is not None else 1
    mine = [p for p in owner if p in layouts and layouts[p].expert == (kind == "expert")]
    per_rank, numel = [0.0] * size, [0] * size
    for param, flops in zip(mine, zero.newton_schulz_flops(mine)):
        per_rank[owner[param]] += flops
        numel[owner[param]] += param.numel()
    return (f"ZayaMuon {kind} (ZeRO-1): {len(mine)} matrices over {size} data-parallel rank(s): Newton–Schulz "
            f"max {max(per_rank, default=0) / 1e9:.2f} GFLOP/rank (ideal {sum(per_rank) / size / 1e9:.2f}), "
            f"master+momentum max {max(numel, default=0) / 1e6:.1f}M elements/rank "
            f"(ideal {sum(numel) / size / 1e6:.1f}M)")


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


class _MuonWrapper:
    """Mixin for Megatron's optimizer wrappers of ZayaMuon.

    Gradients: ZayaMuon reads each matrix's ``main_grad`` (DDP's buffer, fp32 or bf16) itself, so no ``.grad``
    is set on what it steps (Megatron's clipping, which wants fp32 ``.grad``, skips it; the factor reaches
    ZayaMuon through ``ZayaMuonChainedOptimizer``) and the norm comes from a vector of fp32 per-matrix norms.

    Checkpoints (``torch_dist``): each owned item's momentum is a ShardedTensor keyed by its model parameter and
    written by its owner (the data-parallel part of the replica id is 0 there; other ranks do not hold it). A
    whole parameter reuses the parameter's sharding (TP / expert axes, SwiGLU factory); one slice of a 3-D
    parameter is an extra leading-axis fragment. Under ZeRO-1 the owner writes the master weights too. The
    layout does not depend on the parallel sizes, so checkpoints reshard.
    """

    zero1 = False

    def _model_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _torch_state_section(self, sharded: dict) -> dict:
        raise NotImplementedError

    def _filter_grads_for_norm(self, params, param_filter=None) -> list[torch.Tensor]:
        """Megatron's selection for norms (``param_filter``, no shared weights or TP duplicates), as the fp32 norm
        of each matrix's ``main_grad``."""
        tp = dict(tp_group=self.tp_group, expert_tp_group=self.expert_tp_group)
        params = [p for p in params if (param_filter is None or param_filter(p)) and param_is_not_shared(p)
                  and param_is_not_tensor_parallel_duplicate(p, **tp)]  # fmt: skip
        grads = [grad for grad in map(gradient_of, params) if grad is not None]
        if not grads:
            return []
        # one multi-tensor call for all the fp32 sums; the norm of their vector is the norm of all the gradients
        return [torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        muon: ZayaMuon = self.optimizer
        muon.init_state()  # also saved before the first step, so that loading always finds every key
        params = self._model_params()
        own = tracked_sharded_tensors(model_sharded_state_dict, params)
        id_to_sharded = get_param_id_to_sharded_param_map(own, params)
        momentum = momentum_sharded_state(muon, id_to_sharded)
        state, muon.state = muon.state, defaultdict(dict)
        try:  # Megatron's conversion of everything else (master weights, param groups), without the momentum
            sharded = super().sharded_state_dict(own, is_loading=False, metadata=metadata)
        finally:
            muon.state = state
        if self.zero1:  # master weights live on their owner only: it writes them
            for tensor in nested_values(sharded):
                if hasattr(tensor, "replica_id"):
                    tensor.replica_id = _owner_replica_id(tensor.replica_id)
        self._torch_state_section(sharded)["state"] = momentum
        return sharded


class ZayaMuonFloat16Optimizer(_MuonWrapper, Float16OptimizerWithFloat16Params):
    """bf16 training: fp32 master weights (Megatron's) + ZayaMuon.

    Its master weights are saved as ``{group index: [tensors]}`` rather than a list of lists: a group
    with no Muon parameter (Megatron's no-weight-decay group, say) is an empty list, which
    ``dist_checkpointing`` drops from a list of lists, shifting the others at load time.
    """

    def _model_params(self):
        return list(chain.from_iterable(self.float16_groups))

    def _copy_model_grads_to_main_grads(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.main_grad = getattr(model_param, "main_grad", None)
                if main_param.main_grad is None and model_param.grad is not None:  # no DDP: a plain autograd grad
                    main_param.main_grad = model_param.grad
                model_param.grad = None

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


class ZayaMuonFP32Optimizer(_MuonWrapper, FP32Optimizer):
    """fp32 training: ZayaMuon on the model's own parameters."""

    def _model_params(self):
        return self.get_parameters()

    def prepare_grads(self) -> bool:
        return False  # ZayaMuon reads ``main_grad``; Megatron would alias it as ``.grad`` here

    def _torch_state_section(self, sharded):
        return sharded


def tracked_sharded_tensors(model_sharded_state_dict, params) -> dict:
    """The model's sharded tensors (and factories) of ``params`` only, by position: all that Megatron's
    ``get_param_id_to_sharded_param_map`` maps. Given the others, it formats each into a debug message on every
    save (debug logging on or off), the tensor's values included: on a GPU, a device-to-host read each."""
    ids = {id(param) for param in params}
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return dict(enumerate(tensor for tensor in nested_values(tensors) if id(tensor.data) in ids))


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
    replica_id = _owner_replica_id(model_sh.replica_id)
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


def _owner_replica_id(replica_id):
    """The replica id of a tensor that only its owner holds: DP (the last component) 0, so the owner writes it."""
    return 0 if isinstance(replica_id, int) else (*replica_id[:-1], 0)


class ZayaMuonChainedOptimizer(ChainedOptimizer):
    """The ZayaMuon wrappers and AdamW as one Megatron optimizer.

    Megatron's ``ChainedOptimizer.step`` clips the gradients it finds in ``.grad``; ZayaMuon's are read from the
    gradient buffer instead (see ``_MuonWrapper``), so the clipping factor of the step's norm is handed to it
    here. Under ZeRO-1 (``zero_chunks``: the DDP chunks), the owners' updated matrices are then all-gathered
    through DDP's owner-aligned buckets (or, with ``--overlap-param-gather``, by DDP's forward hooks).
    """

    def __init__(self, chained_optimizers, zero_chunks=()):
        super().__init__(chained_optimizers)
        self.zero_chunks = list(zero_chunks)
        self._grad_norm = None

    def get_grad_norm(self):
        self._grad_norm = super().get_grad_norm()
        return self._grad_norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        scale, clip = 1.0, self.config.clip_grad
        if clip > 0.0 and self._grad_norm is not None:
            scale = min(1.0, clip / (self._grad_norm + 1.0e-6))  # as megatron's clip_grad_by_total_norm_fp32
        self._grad_norm = None
        for optimizer in self.chained_optimizers:
            if isinstance(optimizer, _MuonWrapper):
                optimizer.optimizer.grad_scale = scale
        success = super().step_with_ready_grads()
        for chunk in self.zero_chunks:
            if success and not chunk.ddp_config.overlap_param_gather:
                for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                    first = bucket_group.buckets[0].params_list[0] if bucket_group.buckets else None
                    if first is not None and first.is_managed_by_layer_wise_optimizer:  # AdamW syncs its own
                        chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)
        return success


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


def wrap_get_megatron_optimizer(original, install_recipe=None):
    """``get_megatron_optimizer`` that builds ZayaMuon for ``--optimizer zaya_muon`` and defers otherwise; then
    ``install_recipe(optimizer, model_chunks)``, where given, adds the training recipe's hooks."""

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        if config.optimizer != OPTIMIZER_NAME:
            optimizer = original(config, model_chunks, *args, **kwargs)
        else:
            optimizer = get_zaya_muon_optimizer(config, model_chunks, *args, **kwargs)
        return install_recipe(optimizer, model_chunks) if install_recipe else optimizer

    get_megatron_optimizer.__wrapped__ = original
    return get_megatron_optimizer
