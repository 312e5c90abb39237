"""The recipe flags that act in the optimizer step: ``--zaya-router-freeze-tokens`` and ``--zaya-expert-clip-grad``.

``install_recipe`` is called on the optimizer Megatron's ``setup_model_and_optimizer`` builds (the ``optim.zaya_muon``
patch's factory); the mechanisms are ``optim/recipe.py``'s. Tokens are counted as Megatron counts samples
(``consumed_train_samples``, which checkpoints keep) times the sequence length, so a resumed run freezes and thaws
at the same step as an uninterrupted one.
"""

from __future__ import annotations

from ..optim import recipe
from .balancing import routers, write_scalars


def install_recipe(optimizer, model_chunks):
    """Add the router freeze and expert clipping of the command's flags to ``optimizer`` (a ``ChainedOptimizer``)."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size
    from megatron.training import get_args
    from megatron.training.utils import print_rank_0, print_rank_last

    try:
        args = get_args()
    except AssertionError:  # an optimizer built from Python, outside pretrain(): no flags
        return optimizer
    freeze_tokens = getattr(args, "zaya_router_freeze_tokens", 0)
    clip = getattr(args, "zaya_expert_clip_grad", 0.0)
    if not freeze_tokens and not clip:
        return optimizer

    def frozen() -> bool:
        before = args.consumed_train_samples * args.seq_length
        if before >= freeze_tokens > before - get_current_global_batch_size() * args.seq_length:
            print_rank_0(f"[zaya] routers thaw at iteration {args.curr_iteration + 1}: {before} tokens consumed "
                         f"(--zaya-router-freeze-tokens {freeze_tokens})")
        return before < freeze_tokens

    def log_expert_norm(norm: float) -> None:
        iteration = args.curr_iteration + 1
        if iteration % args.log_interval == 0:
            print_rank_last(f" [zaya] iteration {iteration:8d} | expert grad norm: {norm:.3f} | "
                            f"expert clip: {clip:g} |")
            write_scalars({"zaya/expert_grad_norm": norm}, iteration)

    router_params = [p for router in routers(model_chunks) for p in router.parameters()] if freeze_tokens else []
    return recipe.install(optimizer, router_params=router_params, frozen=frozen, expert_clip_grad=clip,
                          on_expert_norm=log_expert_norm)
