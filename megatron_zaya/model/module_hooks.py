"""The hooks of modules whose weights a fused op reads without calling them.

The sublayer ops and the grouped experts read the weights of modules that keep their spec slots and checkpoint
names but not their forward. Megatron's DDP waits for ``--overlap-param-gather``'s all-gather of a module's weights
in its forward pre-hook, which runs only when the module is called: each such module is called here first.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module


def call_module_hooks(*modules: torch.nn.Module) -> None:
    """Call each module for its hooks, without its forward; a module with no hooks, the common case, costs a check."""
    global_hooks = torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
    for module in modules:
        if global_hooks or module._forward_pre_hooks or module._forward_hooks:
            module.forward = _no_forward  # an instance attribute: hides the class's forward for this call
            try:
                module()
            finally:
                del module.forward


def _no_forward() -> None:
    return None
