"""The ops layer (megatron_zaya/ops): kernels stand on nothing of the model, no import circle in the package, the
documented op lists are ``KERNEL_OPS``, and the references are the model's math."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_zaya
from megatron_zaya.config import KERNEL_OPS, zaya_config
from megatron_zaya.ops import cca, experts, lm_head, residual_norm, router

PACKAGE = Path(megatron_zaya.__file__).parent
REPO = PACKAGE.parent
KERNEL_MODULES = sorted(p.stem for p in (PACKAGE / "kernels").glob("*.py") if p.stem != "__init__")
OP_MODULES = sorted(p.stem for p in (PACKAGE / "ops").glob("*.py") if p.stem != "__init__")


def _imported_after(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """In a fresh interpreter, import each of ``modules`` in turn: the forbidden modules each one brought in."""
    script = (
        "import json, sys\n"
        f"forbidden = {forbidden!r}\n"
        "found = {}\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
        "    found[name] = sorted(m for m in sys.modules if m.startswith(forbidden) and m not in sum(found.values(), []))\n"
        "print(json.dumps(found))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    return __import__("json").loads(run.stdout.splitlines()[-1])


def test_kernel_modules_import_neither_megatron_nor_the_model():
    found = _imported_after([f"megatron_zaya.kernels.{name}" for name in KERNEL_MODULES],
                            ("megatron.", "megatron_zaya.model", "megatron_zaya.ops", "megatron_zaya.config"))
    assert len(found) == len(KERNEL_MODULES) >= 8
    assert not any(found.values()), found


def test_op_modules_import_neither_megatron_nor_triton():
    """The references cost nothing to import; the kernels are imported when a ``fused_*`` function first runs."""
    found = _imported_after([f"megatron_zaya.ops.{name}" for name in OP_MODULES],
                            ("megatron.", "megatron_zaya.model", "megatron_zaya.kernels", "triton"))
    assert not any(found.values()), found


def _package_imports(path: Path, modules) -> set[str]:
    """The megatron_zaya modules ``path`` imports, at module level or inside functions (``from package import
    module`` counts as the module alone, as a package's own submodule imports do)."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {name for name in names if name in modules and name != module}


def _import_graph() -> dict[str, set[str]]:
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    return {name: _package_imports(path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_layers_import_downwards_only():
    """model/ calls ops/, ops/ imports kernels/ (lazily), kernels/ imports only its own modules."""
    graph = _import_graph()
    layer = {name: name.split(".")[1] if name.count(".") else "" for name in graph}
    for name, imported in graph.items():
        if layer[name] == "kernels":
            assert all(layer[i] == "kernels" for i in imported if i != "megatron_zaya"), (name, imported)
        if layer[name] == "model":
            assert not any(layer[i] == "kernels" for i in imported), (name, imported)
        if layer[name] == "ops":
            assert not any(layer[i] in ("model", "config") for i in imported), (name, imported)


def test_no_import_circle():
    """No module of the package imports, directly or through others, one that imports it."""
    cycles = _cycles(_import_graph())
    assert not cycles, cycles


@pytest.mark.parametrize("document", ["README.md", "docs/training.md"])
def test_documented_kernel_ops_are_kernel_ops(document):
    lists = re.findall(r"--zaya-kernels all\|none\|([a-z_,]+)", (REPO / document).read_text())
    assert lists and all(found == ",".join(KERNEL_OPS) for found in lists), lists


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_rope_is_megatrons_bit_for_bit(dtype, per_sequence):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, 4, 16, generator=gen).to(dtype)
    freqs = torch.rand(7, 2 if per_sequence else 1, 1, 8, generator=gen) * 50
    unused_group = object()  # the bshd path reads no context-parallel group
    expected = apply_rotary_pos_emb(x, freqs, config=zaya_config("test"), cp_group=unused_group)
    assert torch.equal(cca.rope(x, freqs), expected)


def test_rope_cos_sin_are_computed_once_per_table_and_again_after_it_changes():
    """The kernels' cos and sin of Megatron's rotary table: one computation serves every later call with the same
    table, and a table changed in place (a CUDA graph's, refilled each step) gets new ones, equal to float64's."""
    freqs = torch.rand(7, 2, 1, 8, generator=torch.Generator().manual_seed(0)) * 50
    first = cca.rope_cos_sin(freqs)
    again = cca.rope_cos_sin(freqs)
    assert all(a is b for a, b in zip(first, again))
    freqs.mul_(0.5)
    changed = cca.rope_cos_sin(freqs)
    angles = freqs[:, :, 0, :].double()
    for got, want in zip(changed, (angles.cos(), angles.sin())):
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)


def test_fused_functions_compute_the_reference_where_no_kernel_runs():
    """CPU tensors, kernels compiled (not interpreted): each ``fused_*`` gives its reference's numbers exactly."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 8, generator=gen), torch.rand(8, generator=gen)
    assert torch.equal(residual_norm.fused_rms_norm(x, w, 1e-5), residual_norm.rms_norm(x, w, 1e-5))
    assert torch.equal(experts.fused_swiglu(x), experts.swiglu(x))
    logits, labels = torch.randn(6, 11, generator=gen), torch.randint(0, 11, (6,), generator=gen)
    assert torch.equal(lm_head.fused_cross_entropy(logits, labels), lm_head.cross_entropy(logits, labels))
    biases = torch.zeros(5)
    assert all(torch.equal(a, b) for a, b in zip(router.fused_route_top1(logits[:, :5], biases, 4),
                                                 router.route_top1(logits[:, :5], biases, 4)))


def test_the_choice_reads_the_kernels_field():
    named = zaya_config("test", kernels=",".join(KERNEL_OPS))
    none = zaya_config("test", kernels="none")
    assert residual_norm.choose(named) is residual_norm.FUSED and residual_norm.choose(none) is residual_norm.REFERENCE
    assert cca.choose(named) is cca.fused_cca_qk and cca.choose(none) is cca.cca_qk
    assert router.choose(named) == (router.fused_router_projection, router.fused_route_head)
    assert router.choose(none) == (router.router_projection, router.route_head)
    triton = (experts.grouped_mm.TRITON,) * 2
    assert experts.choose(named, 1, triton) is experts.fused_experts and experts.choose(none, 1, triton) is None
    assert experts.choose(named, 2, triton) is None  # expert tensor parallelism keeps Megatron's loop
    assert lm_head.choose(named, 1) is lm_head.fused_linear_cross_entropy and lm_head.choose(named, 2) is None


def test_core_attention_is_a_config_field():
    """``--zaya-core-attention`` sets ``ZayaConfig.core_attention``, which the layer spec reads."""
    from megatron_zaya.config import ZayaConfigError
    from megatron_zaya.model.core_attention import SDPAttention
    from megatron_zaya.model.specs import get_zaya1_layer_spec

    spec = get_zaya1_layer_spec(zaya_config("test"))
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention
    with pytest.raises(ZayaConfigError, match="sliding layers"):
        zaya_config("test", core_attention="te", attention_types=["global", "sliding"], sliding_window=4)
