"""The ops of the model and of Muon: for each, its torch reference, a lazy binding to its kernel, the choice.

One module per op (``KERNEL_OPS`` in ``config.py`` names them; ``--zaya-kernels`` / ``ZayaConfig.kernels`` picks):

* ``residual_norm``: RMSNorm with ZAYA1's residual merge (op ``residual``)
* ``router``: the router's projection, head (EDA, RMSNorm, MLP) and top-1 (ops ``router``, ``router_head``)
* ``cca``: CCA's convolutions and epilogue with RoPE, and the value delay (op ``cca``)
* ``experts``: the grouped experts with SwiGLU (op ``experts``)
* ``lm_head``: the LM head with the cross-entropy (op ``lm_head``)
* ``moe``, ``cca_sublayer``: the MoE sublayer, and the CCA sublayer up to its attention, each as one autograd op
  over the kernels above (``composite.py``; ops ``moe`` and ``cca_sublayer``)

and Muon's op, set by the ``--zaya-muon-ns-*`` flags (``MuonConfig``), not by the kernels field:

* ``newton_schulz``: the Newton–Schulz orthogonalisation (standard and Gram iterations, CUDA-graph replays);
  ``newton_schulz_path`` chooses kernel and iteration per call, from the matrix's shape, device and dtype

The reference is the model's math and the oracle of the kernel's tests. ``fused_*`` call the kernel, importing
``megatron_zaya/kernels`` on their first call; where the kernel cannot run (a CPU tensor without Triton's
interpreter, a shape it does not take) they compute the reference. ``choose(config, ...)`` is read when the model
is built: the ``fused_*`` functions where ``config.uses_kernel(op)``, else the references. Nothing here imports
Megatron or the kernels at import time.
"""
