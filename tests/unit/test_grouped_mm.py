"""The experts' grouped GEMM with GEMMs by ``torch._grouped_mm`` (ops/grouped_mm.py) against float64 torch, on CPU
in fp32; the Triton GEMMs of a mix by the interpreter. The measured choice table: its lookup, the model's choice,
and the benchmark that writes it (with fake timings). bf16 against the Triton kernel: tests/gpu/test_kernels_gpu.py."""

import json

import pytest
import torch
from triton_interpreter import assert_matches_oracle, assert_weight_grads_match, install, load_kernel_module

from benchmarks import grouped_gemm_backends as bench
from megatron_zaya.config import zaya_config
from megatron_zaya.ops import experts, grouped_mm
from megatron_zaya.ops.grouped_mm import Backends

needs_grouped_mm = pytest.mark.skipif(not grouped_mm.available("cpu", torch.float32),
                                      reason="this torch has no torch._grouped_mm on CPU")

COUNTS = torch.tensor([5, 0, 23, 9])  # an expert without tokens, 37 routed rows
M_DIM, K_DIM, TAIL = 24, 40, 11  # rows of 96 and 160 bytes in fp32; 11 rows of no expert after the routed ones
MIXES = [Backends("torch", "torch", "torch"), Backends("torch", "torch", "triton"),
         Backends("triton", "triton", "torch")]


@pytest.fixture(scope="module")
def interpreted():
    return load_kernel_module("megatron_zaya.kernels.grouped_gemm")


@pytest.fixture
def kernel(interpreted, monkeypatch):
    install(monkeypatch, interpreted)  # ops import the interpreted kernel module
    return interpreted


def _in_one_buffer(gen, order=1, gap=16):
    """E expert weights [M, K] as views into one buffer, ``gap`` elements apart, in expert order or reversed."""
    size = M_DIM * K_DIM + gap
    buffer = 0.2 * torch.randn(len(COUNTS) * size, generator=gen)
    slots = range(len(COUNTS)) if order > 0 else reversed(range(len(COUNTS)))
    return [buffer[s * size: s * size + M_DIM * K_DIM].view(M_DIM, K_DIM).requires_grad_() for s in slots]


def _oracle(x, weights, grad, padded_rows=True):
    x64 = x.detach().double().requires_grad_()
    w64 = torch.stack([w.detach() for w in weights]).double().requires_grad_()
    out = experts.grouped_gemm(x64, w64, COUNTS, padded_rows=padded_rows)
    return [out, *torch.autograd.grad(out, [x64, w64], grad.double())]


@needs_grouped_mm
@pytest.mark.parametrize("backends", MIXES, ids=["all-torch", "wgrad-triton", "wgrad-torch"])
def test_outputs_and_gradients_match_float64(backends, kernel):
    """Weights viewed in place (one buffer, forward order), a padded tail: out, d x, d weight[e]."""
    gen = torch.Generator().manual_seed(0)
    weights = _in_one_buffer(gen)
    x = torch.randn(int(COUNTS.sum()) + TAIL, K_DIM, generator=gen, requires_grad=True)
    grad = torch.randn(x.shape[0], M_DIM, generator=gen)
    assert grouped_mm.runs_on(x, weights, backends)
    assert grouped_mm.stacked(weights).data_ptr() == weights[0].data_ptr()  # a view, not a copy

    out = experts.fused_grouped_gemm(x, weights, COUNTS, padded_rows=True, backends=backends)
    got = [out, *torch.autograd.grad(out, [x, *weights], grad)]
    oracle = _oracle(x, weights, grad)
    assert (got[0][37:] == 0).all() and (got[1][37:] == 0).all()  # rows of no expert: zero, not left unwritten
    assert (got[3] == 0).all()  # the expert without tokens
    assert_matches_oracle("out", got[0], oracle[0])
    assert_matches_oracle("d_x", got[1], oracle[1])
    for e, grad_e in enumerate(got[2:]):
        assert_matches_oracle(f"d_weight[{e}]", grad_e, oracle[2][e])


@needs_grouped_mm
@pytest.mark.parametrize("layout", ["reversed", "stacked"])
def test_weights_not_at_one_forward_stride_are_copied_and_stacked_ones_read_in_place(layout):
    """Megatron's buffers hold the experts in reverse order: a stacked copy, same numbers. One [E, M, K] weight:
    read as it is."""
    gen = torch.Generator().manual_seed(1)
    if layout == "reversed":
        weights = _in_one_buffer(gen, order=-1)
        leaves = weights
    else:
        weights = (0.2 * torch.randn(len(COUNTS), M_DIM, K_DIM, generator=gen)).requires_grad_()
        leaves = [weights]
    x = torch.randn(int(COUNTS.sum()), K_DIM, generator=gen, requires_grad=True)
    grad = torch.randn(x.shape[0], M_DIM, generator=gen)
    assert (grouped_mm.stacked(leaves).data_ptr() == leaves[0].data_ptr()) == (layout == "stacked")
    out = grouped_mm.grouped_gemm(x, weights, COUNTS, backends=MIXES[0])
    got = [out, *torch.autograd.grad(out, [x, *leaves], grad)]
    oracle = _oracle(x, list(weights), grad, padded_rows=False)
    assert_matches_oracle("out", got[0], oracle[0])
    assert_matches_oracle("d_x", got[1], oracle[1])
    assert_matches_oracle("d_weight", torch.stack(got[2:]).view(oracle[2].shape), oracle[2])


@needs_grouped_mm
@pytest.mark.parametrize("enabled", [True, False], ids=["into-main-grad", "off"])
@pytest.mark.parametrize("weight_grad", ["torch", "triton"])
def test_weight_gradients_accumulate_into_main_grad(weight_grad, enabled, kernel, monkeypatch):
    """Experts under Megatron's DDP (a fp32 ``main_grad`` per weight, views into one buffer in reverse order): the
    gradient is added to what ``main_grad`` holds and Megatron's hooks are told; switched off (CUDA-graph
    warm-ups), ``main_grad`` stays and the gradients come back."""
    monkeypatch.setitem(kernel.ACCUMULATE_INTO_MAIN_GRAD, "enabled", enabled)
    gen = torch.Generator().manual_seed(2)
    weights = [(0.2 * torch.randn(M_DIM, K_DIM, generator=gen)).requires_grad_() for _ in COUNTS]
    mains = _in_one_buffer(gen, order=-1, gap=3)
    for weight, main in zip(weights, mains):
        weight.main_grad, weight.grad_added_to_main_grad = main.detach(), False
    before = [w.main_grad.clone() for w in weights]
    x = torch.randn(int(COUNTS.sum()) + TAIL, K_DIM, generator=gen, requires_grad=True)
    grad = torch.randn(x.shape[0], M_DIM, generator=gen)

    out = grouped_mm.grouped_gemm(x, weights, COUNTS, True, Backends("torch", "torch", weight_grad))
    got = torch.autograd.grad(out, weights, grad)
    oracle = _oracle(x, weights, grad)[2]
    assert_weight_grads_match(weights, before, got, oracle, enabled)


@needs_grouped_mm
@pytest.mark.parametrize("in_token_order", ["x", "out"])
@pytest.mark.parametrize("backends", [*MIXES, Backends("torch", "triton", "triton"), grouped_mm.TRITON],
                         ids=["all-torch", "wgrad-triton", "wgrad-torch", "forward-torch", "all-triton"])
def test_rows_in_token_order_give_the_bits_of_explicit_permutations(backends, in_token_order, kernel):
    """The ``moe`` op's calls: x's rows (fc1's) or the output's (fc2's) in token order, which each GEMM permutes its
    own way (the kernel through the sort's order, torch by ``index_select``): the same bits as the call on rows sorted
    by ``index_select`` first, for every mix of backends."""
    gen = torch.Generator().manual_seed(3)
    weights = _in_one_buffer(gen)
    x = torch.randn(int(COUNTS.sum()) + TAIL, K_DIM, generator=gen, requires_grad=True)
    grad = torch.randn(x.shape[0], M_DIM, generator=gen)
    order = torch.randperm(x.shape[0], generator=gen)
    token_order = grouped_mm.TokenOrder(order, order.argsort())
    orders = (token_order, None) if in_token_order == "x" else (None, token_order)
    function, arguments = grouped_mm.autograd_call(x, weights, COUNTS, True, backends, *orders)
    out = function.apply(*arguments)
    got = [out, *torch.autograd.grad(out, [x, *weights], grad)]
    if in_token_order == "x":
        out = grouped_mm.grouped_gemm(x.index_select(0, order), weights, COUNTS, True, backends)
    else:
        out = grouped_mm.grouped_gemm(x, weights, COUNTS, True, backends).index_select(0, token_order.inverse)
    explicit = [out, *torch.autograd.grad(out, [x, *weights], grad)]
    for i, (g, e) in enumerate(zip(got, explicit, strict=True)):
        assert torch.equal(g, e), i


ENTRY = {"device": "NVIDIA H200", "dtype": "bfloat16", "weight": [16, 4096, 2048],
         "backends": {"forward": "torch", "input_grad": "torch", "weight_grad": "triton"}}


def test_lookup_takes_the_measured_entry_and_triton_without_one():
    assert grouped_mm.lookup([ENTRY], "NVIDIA H200", torch.bfloat16, (16, 4096, 2048)) == Backends("torch", "torch")
    for other in [("NVIDIA H100", torch.bfloat16, (16, 4096, 2048)), ("NVIDIA H200", torch.float16, (16, 4096, 2048)),
                  ("NVIDIA H200", torch.bfloat16, (8, 4096, 2048))]:
        assert grouped_mm.lookup([ENTRY], *other) == grouped_mm.TRITON
    for entry in grouped_mm.read_table():  # the committed table: each GEMM on the backend it measured faster
        fastest = Backends(*(min(entry["ms"][gemm], key=entry["ms"][gemm].get) for gemm in Backends._fields))
        dtype = getattr(torch, entry["dtype"])
        assert grouped_mm.lookup(grouped_mm.read_table(), entry["device"], dtype, entry["weight"]) == fastest, entry


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_the_model_takes_the_tables_choice_when_built(torch_has_it, monkeypatch):
    """The ZAYA1-8B experts' fc1 on a GPU with an entry; fc2 unmeasured; a torch without the GEMM: Triton."""
    monkeypatch.setattr(grouped_mm, "device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(grouped_mm, "available", lambda device_type, dtype: torch_has_it)
    monkeypatch.setattr(grouped_mm, "read_table", lambda: [ENTRY])
    config = zaya_config("zaya1-8b", kernels="experts", params_dtype=torch.bfloat16, bf16=True)
    chosen = experts.choose(config, 1, experts.choose_backends(config, 16))
    if torch_has_it:
        assert chosen.func is experts.fused_experts
        assert chosen.keywords["backends"] == (Backends("torch", "torch", "triton"), grouped_mm.TRITON)
    else:
        assert chosen is experts.fused_experts


@needs_grouped_mm
def test_model_built_with_torchs_gemms_equals_the_torch_reference(monkeypatch):
    """The experts op with every GEMM of fc1 and fc2 chosen on ``torch._grouped_mm``: the model's loss and gradients
    are the reference model's (fp32, the other kernels' references on CPU)."""
    from megatron_zaya.pretrained import build_single_process_model

    chosen, calls = Backends("torch", "torch", "torch"), []
    monkeypatch.setattr(grouped_mm, "choose_backends", lambda dtype, shapes: [chosen for _ in shapes])
    run = grouped_mm.grouped_gemm
    monkeypatch.setattr(grouped_mm, "grouped_gemm", lambda *args: calls.append(args[-1]) or run(*args))
    models = [build_single_process_model(zaya_config("test", kernels=kernels, use_cpu_initialization=True,
                                                     params_dtype=torch.float32, moe_token_dispatcher_type="allgather"))
              for kernels in ("none", "experts")]  # fmt: skip
    models[1].load_state_dict(models[0].state_dict())
    assert models[1].decoder.layers[0].mlp.experts.grouped.keywords["backends"] == (chosen, chosen)
    ids = torch.randint(0, models[0].vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in models:
        loss = model(ids, labels=ids)
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert calls == [chosen] * 4  # fc1 and fc2 of both layers
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_benchmark_writes_the_faster_backend_per_gemm_with_its_provenance(tmp_path):
    """Fake timings: torch faster for fc1's forward and fc2's input gradient. A re-measured GPU's entries replace its
    old ones; other GPUs' stay."""
    fast = {("fc1", "forward"), ("fc2", "input_grad")}
    shapes = bench.weight_shapes(zaya_config("zaya1-8b"))
    assert shapes == {"fc1": (16, 4096, 2048), "fc2": (16, 2048, 2048)}

    def fake_ms(name, shape, gemm, backend):
        return 1.0 if ((name, gemm) in fast) == (backend == "torch") else 2.0

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "kept", "entries": [dict(ENTRY, device="AMD Instinct MI300X"),
                                                              dict(ENTRY, backends={"forward": "triton"})]}))
    new = bench.entries(shapes, fake_ms, device="NVIDIA H200", dtype=torch.bfloat16, tokens=8192,
                        command="python -m benchmarks.grouped_gemm_backends --write")
    bench.write_table(path, new)
    table = json.loads(path.read_text())
    assert table["about"] == "kept" and len(table["entries"]) == 3
    assert grouped_mm.lookup(table["entries"], "AMD Instinct MI300X", torch.bfloat16, shapes["fc1"]).forward == "torch"
    fc1, fc2 = (grouped_mm.lookup(table["entries"], "NVIDIA H200", torch.bfloat16, shapes[n]) for n in ("fc1", "fc2"))
    assert fc1 == Backends("torch", "triton", "triton") and fc2 == Backends("triton", "torch", "triton")
    entry = next(e for e in table["entries"] if e["device"] == "NVIDIA H200" and e["weight"] == [16, 4096, 2048])
    assert entry["ms"]["forward"] == {"triton": 2.0, "torch": 1.0} and entry["tokens"] == 8192
    assert {"torch", "triton", "command", "date"} <= set(entry)
