"""Patch group ``pipeline``: the receive buffers of ZAYA1's pipeline stages.

A ZAYA1 stage sends the next one its residual stream and its last layer's router state in one fp32 tensor
``[s, b, hidden + router_hidden]`` (``model/layer.py``). Megatron's schedules size every receive buffer from
``config.hidden_size`` (schedules.py ``get_tensor_shapes`` for 1F1B, an inline shape in the interleaved
schedule), so the widths disagree. All receives of both schedules go through one method,
``P2PCommunicator._communicate``; the patch widens the shape it is given there. The alternatives cost more:
``config.variable_seq_lengths`` sends every shape ahead of its tensor with a device sync each time (and
Megatron refuses it with the allgather dispatcher); ``adjust_tensor_shapes_fn`` reaches 1F1B only and
``megatron.training`` does not let a plugin set it.
"""

from __future__ import annotations

import functools

from .registry import register, replace_attr


def _stage_tensor_width(config) -> int | None:
    """Channels of the tensor between stages of a ZAYA1 model; None for any other model."""
    from megatron_zaya.config import ZayaConfig
    from megatron_zaya.model.layer import stage_tensor_width

    return stage_tensor_width(config) if isinstance(config, ZayaConfig) else None


@register("pipeline.stage_tensor_width",
          target="megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate")
def patch_stage_tensor_width() -> None:
    """Receive ZAYA1's stage tensor ``[s, b, hidden + router_hidden]`` where Megatron expects ``[s, b, hidden]``.

    Wraps ``P2PCommunicator._communicate`` (p2p_communication.py:275): when the communicator's model config
    is a ``ZayaConfig``, the last dim of ``tensor_shape`` (the shape of the buffers it receives into, forward
    activations and their gradients alike) becomes ``stage_tensor_width(config)``. Other models, and shapes
    exchanged at run time (``variable_seq_lengths``), are left alone. Without it a ZAYA1 model refuses to
    build with pipeline parallelism. Off: leave ``pipeline.stage_tensor_width`` out of ``--zaya-patches`` /
    ``ZAYA_PATCHES``.
    """
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    original = P2PCommunicator._communicate

    @functools.wraps(original)
    def _communicate(self, *, tensor_shape, **kwargs):
        width = _stage_tensor_width(self.config)
        if width is not None and tensor_shape is not None and len(tensor_shape) == 3:
            tensor_shape = (*tensor_shape[:2], width)
        return original(self, tensor_shape=tensor_shape, **kwargs)

    replace_attr(P2PCommunicator, "_communicate", _communicate)
