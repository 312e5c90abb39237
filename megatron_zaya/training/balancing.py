"""Once per optimizer step: update every ZAYA1 router's balancing biases, and log the expert load.

Installed as the model config's ``finalize_model_grads_func``, the hook Megatron's training loop calls
once per step after the last micro-batch's backward (``megatron.training.training.train`` keeps a
function a model builder set there). It runs Megatron's own ``finalize_model_grads``, then:

1. sums each router's per-class token counts of this step over the tensor-, data- and context-parallel
   ranks of its pipeline stage (with sequence parallelism every TP rank routes different tokens; without
   it the TP ranks count the same tokens, which scales all counts alike and leaves the shares unchanged);
2. takes one Adam step per router on its biases with gradient ``share - 1/E`` (docs/architecture.md §4.8);
3. every ``--log-interval`` steps, logs the load of the most unbalanced layer in Megatron's
   ``key: value |`` form and every layer's load to TensorBoard / W&B when those are enabled, and warns once
   when a layer stays overloaded (``--zaya-expert-load-warn-ratio/-intervals``).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from ..model.router import ZayaRouter


STATISTICS = ("max share", "min share", "skip rate", "bias min", "bias max")


def routers(model_chunks) -> list[ZayaRouter]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, ZayaRouter)]


def step_balancing(model_chunks) -> list[dict]:
    """All-reduce this step's counts, update the biases, reset the counts; per-layer load statistics."""
    found = routers(model_chunks)
    if not found:
        return []
    counts = torch.stack([r.tokens_per_class for r in found])  # [layers, classes]
    if torch.distributed.is_initialized():
        group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(counts, group=group)
    rows = []
    for router, layer_counts in zip(found, counts):
        router.update_balancing_biases(layer_counts)
        router.tokens_per_class.zero_()
        experts = layer_counts[: router.num_experts].float()
        share = experts / experts.sum().clamp_min(1)
        biases = router.balancing_biases[: router.num_experts]
        skip_rate = layer_counts[router.num_experts:].sum() / layer_counts.sum().clamp_min(1)
        rows.append(torch.stack([share.max(), share.min(), skip_rate.float(), biases.min(), biases.max()]))
    values = torch.stack(rows).tolist()  # one device-to-host copy for every layer's statistics
    return [{"layer": router.layer_number, "experts": router.num_experts, **dict(zip(STATISTICS, row))}
            for router, row in zip(found, values)]


def finalize_model_grads_with_balancing(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Megatron's ``finalize_model_grads`` followed by the ZAYA1 balancing step (see the module docstring)."""
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    stats = step_balancing(model)
    if stats:
        _log(stats)


def _log(stats: list[dict]) -> None:
    from megatron.training import get_args
    from megatron.training.utils import print_rank_last

    args = get_args()
    iteration = getattr(args, "curr_iteration", 0) + 1
    if iteration % args.log_interval:
        return
    worst = max(stats, key=lambda s: s["max share"] - s["min share"])
    print_rank_last(
        f" [zaya] iteration {iteration:8d} | expert share max: {worst['max share']:.3f} | "
        f"expert share min: {worst['min share']:.3f} (layer {worst['layer']}) | "
        f"skip rate: {max(s['skip rate'] for s in stats):.4f} | "
        f"bias range: [{min(s['bias min'] for s in stats):.4f}, {max(s['bias max'] for s in stats):.4f}] |"
    )
    _warn_overloaded(stats, args.zaya_expert_load_warn_ratio, args.zaya_expert_load_warn_intervals, iteration)
    write_scalars({f"zaya/layer{layer['layer']:02d}/{key.replace(' ', '_')}": layer[key]
                   for layer in stats for key in STATISTICS}, iteration)


def write_scalars(values: dict[str, float], iteration: int) -> None:
    """``values`` to TensorBoard and W&B, where their flags are given."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    for writer in (w for w in (get_tensorboard_writer(), get_wandb_writer()) if w is not None):
        for name, value in values.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name, value, iteration)
            else:
                writer.log({name: value}, iteration)


# Per layer, the log intervals in a row whose busiest expert took more than the warning ratio.
_INTERVALS_OVER: dict[int, int] = {}


def _warn_overloaded(stats: list[dict], ratio: float, intervals: int, iteration: int) -> None:
    """One line when a layer's busiest expert has taken more than ``ratio`` times an even share (1/E) for
    ``intervals`` log intervals in a row; the count starts again once it is back under."""
    from megatron.training.utils import print_rank_last

    if ratio <= 0:
        return
    for layer in stats:
        load = layer["max share"] * layer["experts"]
        over = _INTERVALS_OVER.get(layer["layer"], 0) + 1 if load > ratio else 0
        _INTERVALS_OVER[layer["layer"]] = over
        if over == intervals:
            print_rank_last(f" [zaya] warning: iteration {iteration:8d} | layer {layer['layer']}'s busiest expert has "
                            f"taken more than {ratio:g}x an even share for {intervals} log intervals (now "
                            f"{load:.2f}x); check the balancing (--zaya-balancing-lr) |")
