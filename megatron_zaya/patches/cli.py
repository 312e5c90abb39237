"""``zaya-patches``: list the registered patch hooks, or show one's documentation.

    zaya-patches list          # id, group, target, platforms, megatron-core range, kernel?, applies here?, summary
    zaya-patches show cpu.rng  # what it replaces (around which patches of its target), why, how to turn it off
"""

from __future__ import annotations

import argparse
import sys

from . import registry

COLUMNS = ("id", "group", "target", "platforms", "megatron", "kernel", "applies here", "summary")


def _row(patch: registry.Patch, platform: str) -> tuple[str, ...]:
    reason = registry.skip_reason(patch, platform)
    return (
        patch.id,
        patch.group,
        patch.target,
        ",".join(patch.platforms),
        patch.megatron,
        "yes" if patch.kernel else "",
        "yes" if reason is None else f"no: {reason}",
        patch.summary,
    )


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns under a header; the last column (the summary) is not padded."""
    widths = [max(len(cells[i]) for cells in [COLUMNS, *rows]) for i in range(len(COLUMNS) - 1)]
    lines = []
    for cells in [COLUMNS, *rows]:
        padded = [cell.ljust(width) for cell, width in zip(cells, widths)]
        lines.append("  ".join([*padded, cells[-1]]).rstrip())
    return "\n".join(lines)


def list_patches() -> str:
    registry._load_patch_modules()
    platform = registry.current_platform()
    rows = [_row(patch, platform) for patch in sorted(registry.REGISTRY.values(), key=lambda p: p.id)]
    header = f"megatron-core {registry.megatron_version()}, platform {platform}, {len(rows)} patches"
    return f"{header}\n{format_table(rows)}"


def show_patch(patch_id: str) -> str:
    registry._load_patch_modules()
    patch = registry.REGISTRY.get(patch_id)
    if patch is None:
        known = ", ".join(sorted(registry.REGISTRY))
        raise SystemExit(f"zaya-patches: unknown patch id {patch_id!r}; run `zaya-patches list` (known: {known})")
    reason = registry.skip_reason(patch)
    facts = [
        f"{patch.id}  (group {patch.group}{', kernel' if patch.kernel else ''})",
        f"replaces   {patch.target}" + (f", around {', '.join(patch.wraps)}" if patch.wraps else ""),
        f"platforms  {', '.join(patch.platforms)};  megatron-core {patch.megatron}",
        f"here       {'applies' if reason is None else 'skipped: ' + reason}",
    ]
    return "\n".join(facts) + "\n\n" + patch.doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zaya-patches", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="table of every registered patch and whether it would apply here")
    show = commands.add_parser("show", help="the full documentation of one patch")
    show.add_argument("id", help="a patch id, e.g. cpu.rng (see `zaya-patches list`)")
    args = parser.parse_args(argv)
    print(list_patches() if args.command == "list" else show_patch(args.id))


if __name__ == "__main__":
    sys.exit(main())
