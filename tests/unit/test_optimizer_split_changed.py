"""An optimizer state saved with another dense/expert split is refused in one line (megatron_fixes patch)."""

import pytest

from megatron_zaya.errors import UsageError
from megatron_zaya.patches import apply_patches


def test_a_mixed_split_is_refused_and_a_matching_one_passes_through():
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    apply_patches("megatron_fixes.optimizer_split_changed")
    chained = object.__new__(ChainedOptimizer)  # the check runs before any of the instance's state is read
    # What dist_checkpointing.load returns for a one-part checkpoint loaded into a two-part chain: the saved
    # optimizer's string keys and this chain's integer keys.
    with pytest.raises(UsageError, match="split into dense and expert parts differently.*--no-load-optim"):
        chained.load_state_dict({"optimizer": {}, "param_state": {}, 0: {}, 1: {}})
    chained.chained_optimizers = []
    chained.load_state_dict({})  # no mixed keys: Megatron's own method runs
