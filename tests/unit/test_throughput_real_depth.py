"""benchmarks/throughput.py's real-depth parts: what they read from Megatron's log, the memory planner's report
and the :class:`PhaseClock` in the training process, and the step breakdown they derive.

``LOG`` and ``PHASES`` are one CPU run's (``python -m benchmarks.throughput --out DIR --smoke --parts
real_depth``: the ``test`` preset, global batch 8, micro-batch 2, level-2 timers): its ``real_depth/train.log``
from the setup timers to the end of training (Python warnings left out), and its ``phases.json``. The expected
numbers are read from them here by plain string splitting, not by the benchmark's regular expressions.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

import benchmarks.probe
from benchmarks import throughput

LOG = "\n".join([
    'INFO:megatron.core.timers:max time across ranks (ms):',
    '    model-and-optimizer-setup ......................: 53.70',
    '    train/valid/test-data-iterators-setup ..........: 248.44',
    'training ...',
    'Overwriting rerun_state_machine.current_iteration from -1 to 0...',
    '[before the start of training step] datetime: 2026-12-02 03:00:55.660471',
    ' [zaya] iteration        1 | expert share max: 0.564 | expert share min: 0.051 (layer 1) | '
    'skip rate: 0.0000 | bias range: [-0.0010, 0.0010] |',
    ' [2026-12-02 03:00:57.393992] iteration        1/       3 | consumed samples:            8 | '
    'elapsed time per iteration (ms): 1733.6 | learning rate: 3.000000E-04 | global batch size:     8 | '
    'lm loss: 6.271515E+00 | loss scale: 1.0 | grad norm: 1.347 | number of skipped iterations:   0 | '
    'number of nan iterations:   0 |',
    'Number of parameters in transformer block in billions:  0.00',
    'Number of active parameters in transformer block in billions:  0.00',
    'Number of parameters in embedding layers in billions: 0.00',
    'Total number of parameters in billions: 0.00',
    'Total number of active parameters in billions: 0.00',
    'Number of parameters in most loaded shard in billions: 0.0002',
    'compute_activation_memory_without_sp',
    'Activation memory footprint per transformer layer (precise, without SP): 0.3 MB',
    'Theoretical memory footprints: weight and optimizer=3.53 MB, activation=0.71 MB, total=4.24 MB',
    '',
    '[Rank 0] (after 1 iterations) memory (MB) | allocated: 0.00 | max allocated: 0.00 | reserved: 0.00 | '
    'max reserved: 0.00',
    'INFO:megatron.core.timers:max time across ranks (ms):',
    '    forward-backward ...............................: 1667.55',
    '    embedding-grads-all-reduce .....................: 0.07',
    '    all-grads-sync .................................: 4.98',
    '    params-all-gather ..............................: 1.92',
    '    optimizer-copy-to-main-grad ....................: 1.17',
    '    optimizer-inner-step ...........................: 42.00',
    '    optimizer-copy-main-to-model-params ............: 1.03',
    '    optimizer ......................................: 57.20',
    '    forward-compute ................................: 802.29',
    '    backward-compute ...............................: 853.62',
    ' [zaya] iteration        2 | expert share max: 0.566 | expert share min: 0.055 (layer 1) | '
    'skip rate: 0.0000 | bias range: [-0.0020, 0.0020] |',
    ' [2026-12-02 03:00:57.630557] iteration        2/       3 | consumed samples:           16 | '
    'elapsed time per iteration (ms): 236.5 | learning rate: 1.500000E-04 | global batch size:     8 | '
    'lm loss: 6.264400E+00 | loss scale: 1.0 | grad norm: 1.239 | number of skipped iterations:   0 | '
    'number of nan iterations:   0 |',
    'Number of parameters in transformer block in billions:  0.00',
    'Number of active parameters in transformer block in billions:  0.00',
    'Number of parameters in embedding layers in billions: 0.00',
    'Total number of parameters in billions: 0.00',
    'Total number of active parameters in billions: 0.00',
    'Number of parameters in most loaded shard in billions: 0.0002',
    'compute_activation_memory_without_sp',
    'Activation memory footprint per transformer layer (precise, without SP): 0.3 MB',
    'Theoretical memory footprints: weight and optimizer=3.53 MB, activation=0.71 MB, total=4.24 MB',
    '',
    '[Rank 0] (after 2 iterations) memory (MB) | allocated: 0.00 | max allocated: 0.00 | reserved: 0.00 | '
    'max reserved: 0.00',
    'INFO:megatron.core.timers:max time across ranks (ms):',
    '    forward-backward ...............................: 199.46',
    '    embedding-grads-all-reduce .....................: 0.02',
    '    all-grads-sync .................................: 1.11',
    '    params-all-gather ..............................: 0.81',
    '    optimizer-copy-to-main-grad ....................: 0.65',
    '    optimizer-inner-step ...........................: 21.44',
    '    optimizer-copy-main-to-model-params ............: 0.86',
    '    optimizer ......................................: 32.57',
    '    forward-compute ................................: 89.86',
    '    backward-compute ...............................: 103.78',
    ' [zaya] iteration        3 | expert share max: 0.443 | expert share min: 0.064 (layer 1) | '
    'skip rate: 0.0000 | bias range: [-0.0030, 0.0030] |',
    ' [2026-12-02 03:00:57.877435] iteration        3/       3 | consumed samples:           24 | '
    'elapsed time per iteration (ms): 246.8 | learning rate: 0.000000E+00 | global batch size:     8 | '
    'lm loss: 6.251682E+00 | loss scale: 1.0 | grad norm: 1.384 | number of skipped iterations:   0 | '
    'number of nan iterations:   0 |',
    'INFO:megatron.core.timers:max time across ranks (ms):',
    '    forward-backward ...............................: 203.05',
    '    embedding-grads-all-reduce .....................: 0.03',
    '    all-grads-sync .................................: 1.17',
    '    params-all-gather ..............................: 1.04',
    '    optimizer-copy-to-main-grad ....................: 0.73',
    '    optimizer-inner-step ...........................: 25.25',
    '    optimizer-copy-main-to-model-params ............: 0.93',
    '    optimizer ......................................: 39.67',
    '    forward-compute ................................: 93.57',
    '    backward-compute ...............................: 103.15',
    '',
])
PHASES = {"clock": "host clock", "iterations": {
    "1": {"micro_batches": 4, "layers_ms": 1614.8278530017706, "lm_head_ms": 10.277278004650725},
    "2": {"micro_batches": 4, "layers_ms": 165.60962799121626, "lm_head_ms": 8.235660010541324},
    "3": {"micro_batches": 4, "layers_ms": 161.5994529965974, "lm_head_ms": 8.426543001405662},
}}
TOKENS_PER_STEP = 8 * 64


def by_hand(text: str) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Elapsed ms per iteration and the timer block that follows each iteration line."""
    elapsed, timers, current = {}, {}, None
    for line in text.splitlines():
        if "elapsed time per iteration (ms):" in line:
            current = int(line.split("iteration")[1].split("/")[0])
            elapsed[current] = float(line.split("elapsed time per iteration (ms):")[1].split("|")[0])
            timers[current] = {}
        elif current is not None and " ...." in line:
            name, value = line.split(" ....", 1)
            timers[current][name.strip()] = float(value.rsplit(":", 1)[1].strip(" ()").split(",")[-1])
    return elapsed, timers


def test_breakdown_rows_come_from_the_log_and_the_phases():
    summary = throughput.real_depth_summary(LOG, PHASES, warmup=1, tokens_per_step=TOKENS_PER_STEP)
    elapsed, timers = by_hand(LOG)
    timed = [i for i in elapsed if i > 1]
    assert summary["timed_iterations"] == timed == [2, 3] and 1 in elapsed
    assert summary["micro_batches_per_step"] == [PHASES["iterations"][str(i)]["micro_batches"] for i in timed]
    mean_ms = statistics.mean(elapsed[i] for i in timed)
    assert summary["ms_per_iteration"] == pytest.approx(mean_ms)
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(TOKENS_PER_STEP / mean_ms * 1e3)

    def mean(row) -> float:
        return statistics.mean(row(i, timers[i], PHASES["iterations"][str(i)]) for i in timed)

    rows = summary["breakdown_ms"]
    assert rows["layers"] == pytest.approx(mean(lambda i, t, p: p["layers_ms"]))
    assert rows["lm_head"] == pytest.approx(mean(lambda i, t, p: p["lm_head_ms"]))
    assert rows["optimizer"] == pytest.approx(mean(lambda i, t, p: t["optimizer"]))
    assert rows["data_embedding_loss"] == pytest.approx(mean(
        lambda i, t, p: t["forward-compute"] + t["backward-compute"] - p["layers_ms"] - p["lm_head_ms"]))
    assert rows["schedule_grad_finalize"] == pytest.approx(mean(
        lambda i, t, p: t["forward-backward"] - t["forward-compute"] - t["backward-compute"]))
    assert rows["training_loop"] == pytest.approx(mean(
        lambda i, t, p: elapsed[i] - t["forward-backward"] - t["optimizer"]))
    # The rows add up to the step, and host and data to its three parts.
    assert rows["layers"] + rows["lm_head"] + rows["optimizer"] + rows["host_and_data"] == pytest.approx(mean_ms)
    assert rows["host_and_data"] == pytest.approx(
        rows["data_embedding_loss"] + rows["schedule_grad_finalize"] + rows["training_loop"])
    assert {key for key, _, _ in throughput.BREAKDOWN} == set(rows)


def test_minmax_timers_read_as_their_max_and_iterations_without_phases_are_left_out():
    minmax = "\n".join(line.replace(": ", ": (0.01, ", 1) + ")" if " ...." in line else line
                       for line in LOG.splitlines())
    assert throughput.timers_by_iteration(minmax) == by_hand(LOG)[1] == throughput.timers_by_iteration(LOG)
    without_3 = {"clock": PHASES["clock"], "iterations": {k: v for k, v in PHASES["iterations"].items() if k != "3"}}
    assert throughput.real_depth_summary(LOG, without_3, 1, TOKENS_PER_STEP)["timed_iterations"] == [2]
    assert throughput.real_depth_summary(LOG, PHASES, 2, TOKENS_PER_STEP)["timed_iterations"] == [3]
    assert throughput.real_depth_summary(LOG, PHASES, 3, TOKENS_PER_STEP)["timed_iterations"] == []


def test_the_plan_is_read_from_the_planners_report():
    from megatron_zaya import memory_plan
    from megatron_zaya.config import preset, zaya_config

    cfg, par = zaya_config(**preset("zaya1-8b")), memory_plan.Parallel()
    run = memory_plan.Run(micro_batch=2, seq=4096, global_batch=128, distributed_optimizer=True, grad_bf16=True,
                          bf16_momentum=True, recompute="selective",
                          recompute_modules=("layernorm", "cca_qk", "router"))
    plan = throughput.parse_plan(memory_plan.report(cfg, par, run))
    expected = memory_plan.plan(cfg, par, run)
    assert plan["peak_gib"] == pytest.approx(expected["peak"] / memory_plan.GIB, abs=0.005)
    assert plan["between_steps_gib"] == pytest.approx(expected["between steps"] / memory_plan.GIB, abs=0.005)
    assert plan["largest"] == {gpu: memory_plan.largest_micro_batch(cfg, par, run, gib)
                               for gpu, gib in memory_plan.GPUS_GIB.items()}


# What each piece of the fake model below advances the fake clock by, seconds: (forward, backward).
EMBEDDING, LAYERS, LM_HEAD, LOSS = (1.0, 13.0), (5.0, 7.0), (2.0, 3.0), (11.0, 17.0)


class Tick(torch.autograd.Function):
    """Advances the fake clock by ``costs[0]`` in the forward and ``costs[1]`` in the backward."""

    @staticmethod
    def forward(ctx, x, clock, costs):
        ctx.clock, ctx.costs = clock, costs
        clock.now += costs[0]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += ctx.costs[1]
        return grad, None, None


class ZayaTransformerBlock(torch.nn.Module):  # the PhaseClock finds the decoder and the model by class name
    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, hidden):
        return Tick.apply(hidden, self.clock, LAYERS)


class ZayaModel(torch.nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.clock, self.weight = clock, torch.nn.Parameter(torch.ones(3))
        self.decoder = ZayaTransformerBlock(clock)

    def forward(self):
        hidden = self.decoder(Tick.apply(self.weight * 1.0, self.clock, EMBEDDING))
        return Tick.apply(hidden, self.clock, LM_HEAD)


def test_phase_clock_times_the_layers_and_the_lm_head_forward_and_backward(tmp_path, monkeypatch):
    class Clock:
        now = 0.0

    clock, iteration = Clock(), [1]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(benchmarks.probe, "megatron_iteration", lambda: iteration[0])
    phases, model = throughput.PhaseClock(tmp_path), ZayaModel(clock)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(phases.pre_forward),
             torch.nn.modules.module.register_module_forward_hook(phases.post_forward)]
    micro_batches = {1: 2, 2: 3}
    try:
        for iteration[0], count in micro_batches.items():
            for _ in range(count):
                Tick.apply(model(), clock, LOSS).sum().backward()
        with torch.no_grad():  # an evaluation forward: not a training micro-batch
            model()
        model()  # a forward whose backward never runs
    finally:
        for hook in hooks:
            hook.remove()
    phases.write()
    written = json.loads((tmp_path / "phases.json").read_text())
    assert written["clock"] == "host clock"
    assert written["iterations"] == {str(i): {"micro_batches": n, "layers_ms": 1e3 * n * sum(LAYERS),
                                              "lm_head_ms": 1e3 * n * sum(LM_HEAD)}
                                     for i, n in micro_batches.items()}
