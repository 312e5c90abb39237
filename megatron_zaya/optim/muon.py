"""ZayaMuon: Muon with AdamW RMS matching, Newton–Schulz spread over data-parallel ranks.

For every matrix ``W`` [rows, cols] with gradient ``G`` (Liu et al., *Muon is scalable*, 2025):

    M ← μ·M + G                                   # fp32 (or bf16) momentum, only on the matrix's owner
    U ← G + μ·M   (Nesterov)   or   U ← M
    O ← NewtonSchulz(U)                           # quintic, on the full (TP-gathered) matrix
    W ← W·(1 − lr·wd) − lr · 0.2·√max(rows, cols) · O

On GPUs with a 16-bit ``ns_dtype``, wide matrices (with the Triton kernels: long side ≥ 1.27× the short one)
take the Gram form of Newton–Schulz (fewer FLOPs, see ``ops.newton_schulz``) unless ``--zaya-muon-ns-gram
off``, and small batches of matrices replay a CUDA graph of their Newton–Schulz (launch-bound otherwise) unless
``--zaya-muon-ns-graphs off``.

``lr`` and ``wd`` are read from each param group at every step, so Megatron's LR / WD schedule drives
them. With a data-parallel group, each matrix's Newton–Schulz runs on exactly one rank (see ``plan``);
the owners all-gather their ``O`` (in the Newton–Schulz dtype, in windows of bounded size) and every rank
applies all updates, so parameters stay identical across ranks. This assumes the usual DDP gradient
all-reduce: every rank holds full gradients. Under ZeRO-1 (``zero``) each rank's ZayaMuon gets only the matrices
it owns and no data-parallel group: DDP moves the gradients and weights (see ``megatron.get_zaya_muon_optimizer``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_zaya.ops.newton_schulz import DEFAULT_STEPS, QUINTIC_COEFFICIENTS, newton_schulz

from ..dataclass_flags import setting

from .plan import WorkItem, assign_owners, build_items
from .roles import MatrixLayout

#: Newton–Schulz runs on stacks of equally shaped matrices of at most this many elements (memory cap).
NS_BATCH_NUMEL = 1 << 27


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the dtype flags' words


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon hyper-parameters (``--zaya-muon-*`` flags); ``coefficients`` holds one (a, b, c) per step."""

    momentum: float = setting(0.95, flag="--zaya-muon-momentum", help="Muon momentum μ (default 0.95).")
    nesterov: bool = setting(True, flag="--zaya-muon-nesterov", negatable=True,
                             help="Nesterov momentum: orthogonalise G + μ·M instead of M (default on).")
    # one (a, b, c) per Newton–Schulz step: --zaya-muon-ns-steps and --zaya-muon-ns-coefficients (args.py)
    coefficients: tuple[tuple[float, float, float], ...] = (QUINTIC_COEFFICIENTS,) * DEFAULT_STEPS
    eps: float = setting(1e-7, flag="--zaya-muon-ns-eps",
                         help="Added to the Frobenius norm before normalising (default 1e-7).")
    ns_dtype: torch.dtype = setting(torch.bfloat16, flag="--zaya-muon-ns-dtype", choices=DTYPES,
                                    help="Newton–Schulz compute and communication dtype (default bf16).")
    momentum_dtype: torch.dtype = setting(
        torch.float32, flag="--zaya-muon-momentum-dtype", choices=DTYPES,
        help="Muon momentum dtype (default fp32; bf16 halves its memory, see docs/benchmarks.md).")
    update_rms: float = setting(
        0.2, flag="--zaya-muon-update-rms",
        help="Update RMS to match AdamW: updates are scaled by this·√max(rows, cols) (default 0.2).")
    backend: str = setting("auto", flag="--zaya-muon-kernel", choices={k: k for k in ("auto", "torch", "triton")},
                           help="Newton–Schulz kernels: Triton symmetric kernels, torch, or auto (Triton on GPU for "
                                "matrices of at least 512 rows and columns).")
    ns_gram: bool = setting(
        True, flag="--zaya-muon-ns-gram", choices={"auto": True, "off": False},
        help="Gram Newton–Schulz (iterate on the m×m Gram matrix, in fp16 with one restart): auto uses it on GPUs "
             "with a 16-bit --zaya-muon-ns-dtype for matrices where it saves at least 10%% of the FLOPs (with the "
             "Triton kernels: long side >= 1.27x the short one); off keeps the standard iteration everywhere.")
    ns_graphs: bool = setting(
        True, flag="--zaya-muon-ns-graphs", choices={"auto": True, "off": False},
        help="auto: on GPUs, Newton–Schulz of small batches of matrices (at most 2^23 elements: attention and "
             "router matrices) replays a CUDA graph captured at the first step, instead of launching its ~50 "
             "kernels one by one; off: plain launches.")
    split_gate_up: bool = setting(False, flag="--zaya-muon-split-gate-up",
                                  help="Orthogonalise the gate and up halves of each expert's fc1 separately.")
    gather_numel: int = setting(1 << 28, flag="--zaya-muon-gather-numel",
                                help="Elements received per all-gather window when sharing updates over data-parallel "
                                     "ranks (bounds the receive buffer; default 2^28).")

    def __post_init__(self):
        object.__setattr__(self, "coefficients", tuple(tuple(float(x) for x in c) for c in self.coefficients))
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--zaya-muon-momentum must be in [0, 1), got {self.momentum}")
        if not self.coefficients or any(len(c) != 3 for c in self.coefficients):
            raise ValueError("--zaya-muon-ns-coefficients needs one or more (a, b, c) triples")
        if self.update_rms <= 0:
            raise ValueError(f"--zaya-muon-update-rms must be positive, got {self.update_rms}")
        if self.eps < 0:
            raise ValueError(f"--zaya-muon-ns-eps must be at least 0, got {self.eps}")
        if self.gather_numel < 1:
            raise ValueError(f"--zaya-muon-gather-numel must be positive, got {self.gather_numel}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"--zaya-muon-kernel must be auto, torch or triton, got {self.backend!r}")
        for name in ("ns_gram", "ns_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is a boolean (--zaya-muon-{name.replace('_', '-')} auto|off), "
                                 f"got {getattr(self, name)!r}")
        if self.momentum_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--zaya-muon-momentum-dtype must be fp32 or bf16, got {self.momentum_dtype}")


class ZayaMuon(torch.optim.Optimizer):
    """Muon over 2-D matrices and 3-D stacks of them ([slices, rows, cols], each slice on its own).

    Args:
        params: parameters or param groups (``lr`` and ``weight_decay`` may differ per group).
        layouts: ``{param: MatrixLayout}`` for parameters that hold several matrices (see ``roles``);
            others are one matrix (2-D) or one per slice (3-D).
        dp_group: data-parallel group over which the Newton–Schulz work and the momentum are sharded.
        tp_group / expert_tp_group: tensor-parallel groups of the parameters marked
            ``tensor_model_parallel`` (``expert_tp_group`` for layouts with ``expert=True``; defaults to
            ``tp_group``).
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        config: MuonConfig = MuonConfig(),
        layouts: Mapping[torch.Tensor, MatrixLayout] | None = None,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.config = config
        self.grad_scale = 1.0  # gradient clipping's factor for the next step (set by the Megatron wrapper)
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = _size_and_rank(dp_group)
        self._tp = {False: tp_group, True: expert_tp_group if expert_tp_group is not None else tp_group}
        items = build_items(self.param_groups, layouts or {}, _size_and_rank(self._tp[False])[0],
                            _size_and_rank(self._tp[True])[0])
        self.items = assign_owners(items, self.dp_size, len(config.coefficients))
        self.owned = [item for item in self.items if item.owner == self.dp_rank]
        # Each rank's owned items in order, with their offsets in its flat stream of updates.
        self._streams: list[list[tuple[WorkItem, int]]] = [[] for _ in range(self.dp_size)]
        stream_numel = [0] * self.dp_size
        for item in self.items:
            self._streams[item.owner].append((item, stream_numel[item.owner]))
            stream_numel[item.owner] += item.numel
        self._stream_offsets = [[offset for _, offset in entries] for entries in self._streams]
        self._max_stream_numel = max(stream_numel, default=0)

    def _param(self, item: WorkItem) -> torch.Tensor:
        return self.param_groups[item.group]["params"][item.index]

    @staticmethod
    def _slice(tensor: torch.Tensor, item: WorkItem) -> torch.Tensor:
        return tensor[item.slice_index] if tensor.dim() == 3 else tensor

    def _momentum(self, item: WorkItem) -> torch.Tensor:
        param = self._param(item)
        buffers = self.state[param].setdefault("momentum", {})
        if item.slice_index not in buffers:
            buffers[item.slice_index] = torch.zeros(item.local_shape, dtype=self.config.momentum_dtype,
                                                    device=param.device)
        return buffers[item.slice_index]

    def init_state(self) -> None:
        """Create the (zero) momentum of every owned item, e.g. before loading a checkpoint into it."""
        for item in self.owned:
            self._momentum(item)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # decoupled weight decay first; the updates are added to it
            if group["params"] and group["weight_decay"]:
                torch._foreach_mul_(group["params"], 1.0 - group["lr"] * group["weight_decay"])
        if self.dp_size == 1:  # applied batch by batch: no update outlives its Newton–Schulz batch
            for batch in self._orthogonalised_owned():
                updates = _Updates(self)
                for item, update in batch:
                    updates.add(item, update.view(-1), 0, item.numel)
                updates.apply()
        else:
            updates = dict(pair for batch in self._orthogonalised_owned() for pair in batch)
            self._exchange_and_apply([updates[item] for item in self.owned])
        return loss

    def _orthogonalised_owned(self) -> Iterator[list[tuple[WorkItem, torch.Tensor]]]:
        """``[(item, O), ...]`` per Newton–Schulz batch of this rank's items, O its local update in the NS dtype.

        Equally shaped matrices are orthogonalised together, in batches of at most ``NS_BATCH_NUMEL``
        elements, so the fp32 working set stays bounded whatever the number of owned matrices.
        """
        cfg = self.config
        by_shape: dict[tuple[int, int], list[WorkItem]] = defaultdict(list)
        for item in self.owned:
            by_shape[item.block_shape].append(item)
        for (rows, cols), items in by_shape.items():
            for batch in _batches(items, max(1, NS_BATCH_NUMEL // (rows * cols))):
                blocks = self._update_blocks(batch, rows, cols)
                results = newton_schulz(blocks, cfg.coefficients, cfg.eps, cfg.ns_dtype, cfg.backend,
                                        iteration="auto" if cfg.ns_gram else "standard",
                                        graphed=cfg.ns_graphs)
                parts = results.split([i.layout.row_blocks for i in batch])
                yield [(item, self._local_update(item, result)) for item, result in zip(batch, parts)]

    def _update_blocks(self, batch: list[WorkItem], rows: int, cols: int) -> torch.Tensor:
        """Momentum step of each item, and the batch's Nesterov updates (TP-gathered) as one [blocks, rows, cols]
        fp32 tensor: ``M ← G + μ·M`` in place, then ``G + μ·M`` written straight into the batch (two passes)."""
        mu = self.config.momentum
        out = torch.empty(sum(i.layout.row_blocks for i in batch), rows, cols, dtype=torch.float32,
                          device=self._param(batch[0]).device)
        start = 0
        for item in batch:
            param = self._param(item)
            grad = gradient_of(param)
            if grad is None:
                raise RuntimeError(
                    f"ZayaMuon: a parameter of shape {tuple(param.shape)} has no gradient; every Muon parameter "
                    "needs one at each step (leave frozen parameters out of the optimizer)"
                )
            grad, momentum = self._slice(grad, item), self._momentum(item)
            if self.grad_scale != 1.0:  # clipping, one matrix at a time (the gradient buffer stays as it is)
                grad = grad.float() * self.grad_scale
            torch.add(grad, momentum, alpha=mu, out=momentum)
            target = out[start : start + item.layout.row_blocks]
            start += item.layout.row_blocks
            tp_group = self._tp[item.layout.expert]
            tp_size, _ = _size_and_rank(tp_group)
            if item.tp_dim is None:  # the blocks of a whole matrix are a plain view of it
                dest = target.view(item.local_shape)
                if self.config.nesterov:
                    torch.add(grad, momentum, alpha=mu, out=dest)
                else:
                    dest.copy_(momentum)
                continue
            update = grad.float().add(momentum, alpha=mu) if self.config.nesterov else momentum
            target.copy_(_to_blocks(_all_gather_cat(update, item.tp_dim, tp_group, tp_size), item, tp_size))
        return out

    def _local_update(self, item: WorkItem, blocks: torch.Tensor) -> torch.Tensor:
        """Orthogonalised [row_blocks, rows, cols] -> this rank's TP shard of the slice, contiguous."""
        tp_size, tp_rank = _size_and_rank(self._tp[item.layout.expert])
        full = _from_blocks(blocks, item, tp_size)
        if item.tp_dim is not None:
            full = full.chunk(tp_size, dim=item.tp_dim)[tp_rank]
        return full.contiguous()

    def _exchange_and_apply(self, updates: list[torch.Tensor]) -> None:
        """All-gather the owners' updates window by window and add ``-lr·scale·O`` to every parameter.

        Rank r's updates form one flat stream (its items in order); window w of every stream is gathered
        at once, so the receive buffer holds at most ``gather_numel`` elements whatever the model size.
        """
        if self._max_stream_numel == 0:
            return
        dtype, device = self.config.ns_dtype, self._param(self.items[0]).device
        stream = torch.cat([u.view(-1).to(dtype) for u in updates] or [torch.empty(0, dtype=dtype, device=device)])
        window = min(max(1, self.config.gather_numel // self.dp_size), self._max_stream_numel)
        received = torch.empty(self.dp_size, window, dtype=dtype, device=device)
        send = torch.zeros(window, dtype=dtype, device=device)
        for start in range(0, self._max_stream_numel, window):
            chunk = stream[start : start + window]
            send[: chunk.numel()] = chunk
            send[chunk.numel() :] = 0
            dist.all_gather_into_tensor(received.view(-1), send, group=self.dp_group)
            pending = _Updates(self)
            for rank, entries in enumerate(self._streams):
                first = max(bisect.bisect_right(self._stream_offsets[rank], start) - 1, 0)
                for item, offset in entries[first:]:
                    if offset >= start + window:
                        break
                    lo, hi = max(start, offset), min(start + window, offset + item.numel)
                    if lo < hi:
                        pending.add(item, received[rank, lo - start : hi - start], lo - offset, hi - offset)
            pending.apply()  # before the next window overwrites ``received``


class _Updates:
    """``param[slice].flat[lo:hi] -= lr · scale · values`` for many items: one foreach add per (lr, scale). Where the
    values' dtype is not the parameter's, torch's foreach adds them one by one (each reading the 16-bit values as
    they are, no fp32 copy first), in one call from Python."""

    def __init__(self, muon: ZayaMuon):
        self.muon = muon
        self.by_alpha: dict[float, tuple[list, list]] = defaultdict(lambda: ([], []))

    def add(self, item: WorkItem, values: torch.Tensor, lo: int, hi: int) -> None:
        muon = self.muon
        target = muon._slice(muon._param(item), item).view(-1)[lo:hi]
        alpha = -muon.param_groups[item.group]["lr"] * item.update_scale(muon.config.update_rms)
        targets, sources = self.by_alpha[alpha]
        targets.append(target)
        sources.append(values)

    def apply(self) -> None:
        for alpha, (targets, sources) in self.by_alpha.items():
            torch._foreach_add_(targets, sources, alpha=alpha)
        self.by_alpha.clear()


def _batches(items: list[WorkItem], max_matrices: int) -> Iterator[list[WorkItem]]:
    """Consecutive runs of ``items`` holding at most ``max_matrices`` matrices (at least one item each)."""
    batch, count = [], 0
    for item in items:
        if batch and count + item.layout.row_blocks > max_matrices:
            yield batch
            batch, count = [], 0
        batch.append(item)
        count += item.layout.row_blocks
    if batch:
        yield batch


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient ZayaMuon reads: ``main_grad`` where Megatron keeps one (a view into DDP's buffer, fp32 or bf16;
    read matrix by matrix, never copied whole), else ``grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather_cat(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _shards_along_rows(item: WorkItem, tp_size: int) -> int:
    return tp_size if item.layout.blocks_per_tp_shard and item.tp_dim == 0 else 1


def _to_blocks(full: torch.Tensor, item: WorkItem, tp_size: int) -> torch.Tensor:
    """[rows, cols] -> [row_blocks, rows / row_blocks, cols] (undoing a per-TP-shard block interleave)."""
    k, s = item.layout.row_blocks, _shards_along_rows(item, tp_size)
    rows, cols = full.shape
    return full.reshape(s, k, rows // (s * k), cols).transpose(0, 1).reshape(k, rows // k, cols)


def _from_blocks(blocks: torch.Tensor, item: WorkItem, tp_size: int) -> torch.Tensor:
    """Inverse of ``_to_blocks``."""
    k, s = item.layout.row_blocks, _shards_along_rows(item, tp_size)
    _, block_rows, cols = blocks.shape
    return blocks.reshape(k, s, block_rows // s, cols).transpose(0, 1).reshape(k * block_rows, cols)
