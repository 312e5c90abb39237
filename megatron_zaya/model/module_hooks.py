"""The hooks of modules whose weights a fused op reads without calling them.

The sublayer ops, the grouped experts and the router read the weights of modules that keep their spec slots and
checkpoint names but not their forward. Megatron's DDP waits for ``--overlap-param-gather``'s all-gather of a
module's weights in its forward pre-hook, which runs only when the module is called: each such module is called
here first.
"""

from __future__ import annotations

import torch


def call_module_hooks(*modules: torch.nn.Module) -> None:
    """Call each module that has hooks of its own for them, without its forward. A module without (the common case)
    costs a check; torch's global module hooks, which instrument every call (the benchmarks' clocks), do not count."""
    for module in modules:
        if module._forward_pre_hooks or module._forward_hooks:
            module.forward = _no_forward  # an instance attribute: hides the class's forward for this call
            try:
                module()
            finally:
                del module.forward


def _no_forward() -> None:
    return None
