"""``zaya-torchrun`` (``python -m megatron_zaya.launch``): torchrun, whose exit status after a pre-emption
says whether the job stopped cleanly. Its arguments are torchrun's:

    zaya-torchrun --nproc-per-node 8 -m megatron_zaya.pretrain --zaya-preset zaya1-8b ... --save ckpt

On SIGTERM or SIGINT it passes the signal to the workers and exits 0 when every one of them exited 0 (each
saved its checkpoint); torchrun exits 1 then. Any other outcome is torchrun's: a worker that fails, or one
still running at the end of ``--shutdown-timeout``, makes it exit 1. The patch ``launch.clean_stop_exits_0``
(megatron_zaya/patches/launch.py) says how.
"""

from .patches.registry import apply_patches, resolve


def main() -> None:
    selected, _ = resolve(None)  # ZAYA_PATCHES, as the workers read it, can leave the launch group out
    apply_patches(",".join(p.id for p in selected if p.group == "launch") or "none")
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
