"""The launch scripts under fake Slurm: what every node would run, and with which environment.

examples/launch/presets.sh is checked against the environment this file expects per platform; the
sbatch scripts run under fake `srun`/`scontrol`/`zaya-torchrun`/... (tests/unit/launch_fakebin, which
record their argv and environment) for a 2-node x 8-GPU job, and the tests assert the exact
torchrun command line and environment of each node, the container and log options, the requeue
on a time-limit or pre-emption signal, and the one-node examples/pretrain.sh.
"""

import base64
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKEBIN = Path(__file__).resolve().parent / "launch_fakebin"
PRESETS = REPO / "examples/launch/presets.sh"
SLURM = REPO / "examples/slurm"

# What each platform must get (the project's launch settings, AMD's ROCm guidance, NVIDIA's), written out
# here rather than read from presets.sh.
COMMON_ENV = {
    "GPUS_PER_NODE": "8",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TORCH_NCCL_HIGH_PRIORITY": "1",
    "PYTHONUNBUFFERED": "1",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300",
}
ROCM_ENV = {
    "HSA_NO_SCRATCH_RECLAIM": "1",
    "HSA_ENABLE_SCRATCH_ASYNC_RECLAIM": "0",
    "GPU_MAX_HW_QUEUES": "2",
    "HIP_FORCE_DEV_KERNARG": "1",
    "NCCL_IB_GID_INDEX": "3",
    "NCCL_CROSS_NIC": "0",
    "RCCL_MSCCL_ENABLE": "0",
}
NVIDIA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PLATFORM_ENV = {
    "mi300x": COMMON_ENV | ROCM_ENV,
    "mi355x": COMMON_ENV | ROCM_ENV | {"RCCL_WARP_SPEED_AUTO": "0"},
    "h100": COMMON_ENV | NVIDIA_ENV,
    "h200": COMMON_ENV | NVIDIA_ENV,
}
MICRO_BATCH_8B = {"mi300x": "4", "mi355x": "8", "h100": "1", "h200": "2"}
H100_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

HOSTS = ["gpu-a01", "gpu-a02"]
JOB_ID = 4242
MASTER_PORT = str(20000 + JOB_ID % 10000)


def base_env(tmp_path: Path, **extra) -> dict[str, str]:
    """A clean environment with the fakes first on PATH, then this venv (python3 with megatron-zaya)."""
    (tmp_path / "records").mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": f"{FAKEBIN}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_SLURM_RECORDS": str(tmp_path / "records"),
        "FAKE_SLURM_HOSTS": " ".join(HOSTS),
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def slurm_job_env(tmp_path: Path, **extra) -> dict[str, str]:
    """What Slurm puts into a 2-node batch job submitted from the repository root."""
    return base_env(
        tmp_path,
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOB_NUM_NODES=2,
        SLURM_JOB_NODELIST="gpu-a[01-02]",
        SLURM_CPUS_ON_NODE=128,
        SLURM_SUBMIT_DIR=REPO,
        **extra,
    )


def records(tmp_path: Path, tool: str) -> list[dict]:
    found = sorted((tmp_path / "records").glob(f"*-{tool}-*.json"))
    return [json.loads(path.read_text()) for path in found]


def by_node(calls: list[dict]) -> list[dict]:
    return sorted(calls, key=lambda call: int(call["env"]["SLURM_NODEID"]))


def run(script: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


# --- presets.sh --------------------------------------------------------------------------------


def _decode_env(dump: str) -> dict[str, str]:
    entries = base64.b64decode(dump).decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if entry)


def source_presets(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Source presets.sh in bash; return the run and the variables it added or changed."""
    dump = "env -0 | base64 -w0; echo"
    script = f'set -euo pipefail; before=$({dump}); source "{PRESETS}"; echo "$before"; {dump}'
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return proc, {}
    before, after = (_decode_env(line) for line in proc.stdout.split())
    return proc, {k: v for k, v in after.items() if before.get(k) != v and k != "_"}


@pytest.mark.parametrize("platform", sorted(PLATFORM_ENV))
def test_presets_set_exactly_the_platform_environment(tmp_path, platform):
    proc, added = source_presets(base_env(tmp_path, ZAYA_PLATFORM=platform))
    assert proc.returncode == 0, proc.stderr
    assert added == PLATFORM_ENV[platform]


def test_presets_keep_values_the_user_exported(tmp_path):
    env = base_env(tmp_path, ZAYA_PLATFORM="h200", NCCL_NVLS_ENABLE="1", GPUS_PER_NODE="4",
                   NCCL_SOCKET_IFNAME="ens7")
    proc, added = source_presets(env)
    assert proc.returncode == 0, proc.stderr
    expected = PLATFORM_ENV["h200"] | {"GLOO_SOCKET_IFNAME": "ens7"}
    del expected["NCCL_NVLS_ENABLE"], expected["GPUS_PER_NODE"]
    assert added == expected


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "ZAYA_PLATFORM='' is not a known platform"),
        ({"ZAYA_PLATFORM": "mi250"}, "ZAYA_PLATFORM='mi250' is not a known platform"),
        ({"ZAYA_PLATFORM": "h100", "ZAYA_GEMM_TUNING": "use", "ZAYA_GEMM_TUNING_FILE": "/x"}, "ROCm-only"),
        ({"ZAYA_PLATFORM": "mi300x", "ZAYA_GEMM_TUNING": "use", "ZAYA_GEMM_TUNING_FILE": "/nonexistent"},
         "does not exist"),
        ({"ZAYA_PLATFORM": "mi300x", "ZAYA_GEMM_TUNING": "record"}, "needs ZAYA_GEMM_TUNING_FILE"),
        ({"ZAYA_PLATFORM": "mi300x", "ZAYA_GEMM_TUNING": "on"}, "must be off, record or use"),
    ],
)
def test_presets_reject_bad_settings_in_one_line(tmp_path, extra, message):
    proc, _ = source_presets(base_env(tmp_path, **extra))
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and message in proc.stderr


@pytest.mark.parametrize("mode, variable", [("record", "HIPBLASLT_TUNING_FILE"), ("use", "HIPBLASLT_TUNING_OVERRIDE_FILE")])
def test_presets_gemm_tuning_points_hipblaslt_at_the_file(tmp_path, mode, variable):
    tuning_file = tmp_path / "gemm.txt"
    tuning_file.write_text("")
    env = base_env(tmp_path, ZAYA_PLATFORM="mi300x", ZAYA_GEMM_TUNING=mode, ZAYA_GEMM_TUNING_FILE=tuning_file)
    proc, added = source_presets(env)
    assert proc.returncode == 0, proc.stderr
    assert added == PLATFORM_ENV["mi300x"] | {variable: str(tuning_file)}


# --- pretrain_zaya1_8b.sbatch ------------------------------------------------------------------


def expected_train_args(run_dir: Path, data: list[str], tokenizer: Path, micro_batch: str) -> list[str]:
    return [
        "--zaya-preset", "zaya1-8b", "--seq-length", "4096", "--micro-batch-size", micro_batch,
        "--global-batch-size", "1024", "--train-iters", "100000", "--optimizer", "zaya_muon",
        "--lr", "4e-4", "--min-lr", "4e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2000",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--use-distributed-optimizer",
        "--data-path", *data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
        "--save", f"{run_dir}/checkpoints", "--ckpt-format", "torch_dist", "--save-interval", "1000",
        "--exit-signal-handler", "--zaya-watchdog-seconds", "300", "--log-interval", "10", "--log-throughput",
        "--tensorboard-dir", f"{run_dir}/tensorboard", "--eval-interval", "1000", "--eval-iters", "10",
    ]


def torchrun_argv(node_rank: int, command_args: list[str]) -> list[str]:
    return [
        "--nnodes=2", "--nproc-per-node=8", f"--node-rank={node_rank}", f"--master-addr={HOSTS[0]}",
        f"--master-port={MASTER_PORT}", "--max-restarts=3", "--no-python", "zaya-pretrain", *command_args,
    ]


def pretrain_job(tmp_path: Path, platform: str, **extra) -> tuple[dict[str, str], Path, list[str], Path]:
    run_dir, data_dir, tokenizer = tmp_path / "run", tmp_path / "data", tmp_path / "tokenizer"
    data_dir.mkdir(parents=True)
    tokenizer.mkdir()
    data = ["0.7", f"{data_dir}/web_text_document", "0.3", f"{data_dir}/code_text_document"]
    env = slurm_job_env(tmp_path, ZAYA_PLATFORM=platform, RUN_DIR=run_dir, DATA_PATH=" ".join(data),
                        TOKENIZER=tokenizer, CONTAINER_IMAGE="/images/megatron-zaya.sqsh", **extra)
    return env, run_dir, data, tokenizer


@pytest.mark.parametrize("platform", ["mi300x", "h100"])
def test_pretrain_sbatch_gives_each_node_its_torchrun_line_and_environment(tmp_path, platform):
    env, run_dir, data, tokenizer = pretrain_job(tmp_path, platform)
    proc = run(SLURM / "pretrain_zaya1_8b.sbatch", env, tmp_path)
    assert proc.returncode == 0, proc.stderr

    assert [c["argv"][1:] for c in records(tmp_path, "scontrol")] == [["show", "hostnames", "gpu-a[01-02]"]]
    (srun,) = records(tmp_path, "srun")
    data_dir = tmp_path / "data"
    mounts = ",".join(f"{p}:{p}" for p in (REPO, tmp_path, run_dir, data_dir, tokenizer))
    assert srun["options"] == {
        "nodes": "2", "ntasks-per-node": "1", "cpus-per-task": "128", "kill-on-bad-exit": "1",
        "output": f"{run_dir}/logs/train-%j-restart0-node%n.log",
        "container-image": "/images/megatron-zaya.sqsh", "container-mounts": mounts,
        "container-workdir": str(tmp_path), "no-container-mount-home": "",
    }
    train_args = expected_train_args(run_dir, data, tokenizer, MICRO_BATCH_8B[platform])
    if platform == "h100":
        train_args += H100_RECOMPUTE
    train_args += ["--load", f"{run_dir}/checkpoints"]
    nodes = by_node(records(tmp_path, "zaya-torchrun"))
    assert len(nodes) == 2
    for rank, call in enumerate(nodes):
        assert call["argv"][1:] == torchrun_argv(rank, train_args)
        expected_env = PLATFORM_ENV[platform] | {
            "MASTER_ADDR": HOSTS[0], "MASTER_PORT": MASTER_PORT, "SLURM_NODEID": str(rank),
            "SLURMD_NODENAME": HOSTS[rank],
        }
        assert {k: call["env"].get(k) for k in expected_env} == expected_env
        other_platform = NVIDIA_ENV if platform.startswith("mi") else ROCM_ENV
        assert not set(other_platform) & set(call["env"])
        log = (run_dir / f"logs/train-{JOB_ID}-restart0-node{rank}.log").read_text()
        assert f"fake zaya-torchrun on node {rank}" in log and "ok: megatron-zaya on megatron-core" in log
    # Node 0 prints the environment it trains with.
    node0_log = (run_dir / f"logs/train-{JOB_ID}-restart0-node0.log").read_text().splitlines()
    assert {f"{k}={v}" for k, v in PLATFORM_ENV[platform].items()} <= set(node0_log)


def test_pretrain_sbatch_asks_slurm_for_requeue_and_a_warning_before_the_limit():
    script = (SLURM / "pretrain_zaya1_8b.sbatch").read_text()
    directives = [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert {"--requeue", "--open-mode=append", "--ntasks-per-node=1"} <= set(directives)
    (signal_directive,) = [d for d in directives if d.startswith("--signal=")]
    assert signal_directive.startswith("--signal=B:USR1@")
    # The warning must leave torchrun's grace period for the checkpoint, and then some.
    assert int(signal_directive.rsplit("@", 1)[1]) > int(COMMON_ENV["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_pretrain_sbatch_checkpoints_then_requeues_on_signal(tmp_path, signum):
    env, run_dir, _, _ = pretrain_job(tmp_path, "mi355x", FAKE_TORCHRUN_MODE="wait_for_term",
                                      CONTAINER_RUNTIME="apptainer")
    batch = subprocess.Popen(["bash", str(SLURM / "pretrain_zaya1_8b.sbatch")], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(records(tmp_path, "zaya-torchrun")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(records(tmp_path, "zaya-torchrun")) == 2, batch.communicate(timeout=5)
    batch.send_signal(signum)
    _, stderr = batch.communicate(timeout=30)
    assert batch.returncode == 0, stderr

    stopped = records(tmp_path, "zaya-torchrun-terminated")
    requeues = [c for c in records(tmp_path, "scontrol") if c["argv"][1] == "requeue"]
    assert sorted(c["env"]["SLURM_NODEID"] for c in stopped) == ["0", "1"]
    assert [c["argv"][1:] for c in requeues] == [["requeue", str(JOB_ID)]]
    assert max(c["time"] for c in stopped) < requeues[0]["time"]  # checkpoint first, then requeue
    (apptainer_call, _) = records(tmp_path, "apptainer")
    assert apptainer_call["options"]["rocm"] == "" and "nv" not in apptainer_call["options"]
    assert apptainer_call["image"] == "/images/megatron-zaya.sqsh"


def _record_excluded_node(run_dir: Path, node: str) -> None:
    """What a rank on ``node`` writes to the event ledger when its self-test fails."""
    code = ("import sys; from megatron_zaya.training.ledger import Ledger; ledger = Ledger(); "
            "ledger.open(sys.argv[1]); ledger.record('node_excluded', cause='self-test of rank 9 (cuda:1): ...')")
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", code, str(run_dir / "checkpoints")], check=True,
                   env={"SLURMD_NODENAME": node, "RANK": "9", "PATH": "/usr/bin:/bin"}, cwd=REPO)


def test_pretrain_sbatch_requeues_a_failed_step_without_the_nodes_the_ledger_excludes(tmp_path):
    """A node failed its self-test (its zaya-torchrun exits 6) and the ledger names it: the job is requeued with it
    added to the nodes it already excludes; once MAX_REQUEUES requeues on failure without a new checkpoint are
    spent, the failure ends it; a new checkpoint starts the count again."""
    env, run_dir, _, _ = pretrain_job(tmp_path, "h200", FAKE_TORCHRUN_FAIL_NODE="1", FAKE_TORCHRUN_FAIL_CODE="6",
                                      CONTAINER_RUNTIME="none", FAKE_SLURM_EXCLUDED="gpu-c07", MAX_REQUEUES="2")
    _record_excluded_node(run_dir, "gpu-a02")
    for requeue in (1, 2):
        proc = run(SLURM / "pretrain_zaya1_8b.sbatch", env, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert f"requeueing job {JOB_ID} ({requeue} of 2 requeues on failure)" in proc.stderr
    calls = [c["argv"][1:] for c in records(tmp_path, "scontrol") if c["argv"][1] != "show"]
    assert calls == 2 * [["update", f"JobId={JOB_ID}", "ExcludeNodeList=gpu-a02,gpu-c07"], ["requeue", str(JOB_ID)]]
    assert (run_dir / "logs/failure-requeues").read_text() == "2 100000\n"  # node 0 saved 100000 each time
    (srun, _) = records(tmp_path, "srun")
    assert not any(option.startswith("container") for option in srun["options"])

    proc = run(SLURM / "pretrain_zaya1_8b.sbatch", env, tmp_path)
    assert proc.returncode == 6 and "after 2 requeues on failure without a new checkpoint" in proc.stderr
    assert len([c for c in records(tmp_path, "scontrol") if c["argv"][1] == "requeue"]) == 2
    proc = run(SLURM / "pretrain_zaya1_8b.sbatch", env | {"TRAIN_ITERS": "100010"}, tmp_path)  # a new checkpoint
    assert proc.returncode == 0 and "(1 of 2 requeues on failure)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("code, words", [(5, "crash loop (exit 5"), (2, "refused its input (exit 2")])
def test_pretrain_sbatch_leaves_bad_input_and_a_crash_loop_to_a_person(tmp_path, code, words):
    env, _, _, _ = pretrain_job(tmp_path, "h200", FAKE_TORCHRUN_FAIL_NODE="0", FAKE_TORCHRUN_FAIL_CODE=str(code),
                                CONTAINER_RUNTIME="none")
    proc = run(SLURM / "pretrain_zaya1_8b.sbatch", env, tmp_path)
    assert proc.returncode == code and words in proc.stderr, proc.stderr
    assert [c["argv"][1:3] for c in records(tmp_path, "scontrol")] == [["show", "hostnames"]]


def test_pretrain_sbatch_names_every_missing_variable(tmp_path):
    proc = run(SLURM / "pretrain_zaya1_8b.sbatch", slurm_job_env(tmp_path, ZAYA_PLATFORM="mi300x"), tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == "error: set RUN_DIR DATA_PATH TOKENIZER before sbatch (the header of this script explains each)\n"
    assert not records(tmp_path, "srun")


# --- hf_roundtrip.sbatch -----------------------------------------------------------------------


def test_hf_roundtrip_imports_trains_exports_and_resumes(tmp_path):
    hf_model, run_dir = tmp_path / "ZAYA1-8B", tmp_path / "run"
    hf_model.mkdir()
    (tmp_path / "data").mkdir()
    env = slurm_job_env(tmp_path, ZAYA_PLATFORM="mi300x", HF_MODEL=hf_model, RUN_DIR=run_dir,
                        DATA_PATH=tmp_path / "data/domain_text_document", CONTAINER_RUNTIME="none")
    first = run(SLURM / "hf_roundtrip.sbatch", env, tmp_path)
    assert first.returncode == 0, first.stderr
    converts = [c["argv"][1:] for c in records(tmp_path, "zaya-convert")]
    assert converts == [
        ["import-hf", str(hf_model), f"{run_dir}/imported"],
        ["export-hf", f"{run_dir}/checkpoints", f"{run_dir}/hf-iter1000", "--tokenizer", str(hf_model)],
    ]
    for call in records(tmp_path, "zaya-torchrun"):
        assert call["argv"][-3:] == ["--load", f"{run_dir}/imported", "--finetune"]
        assert call["argv"][call["argv"].index("--tokenizer-model") + 1] == str(hf_model)

    # Restart (e.g. after a requeue) with more iterations: no second import, resume, export anew.
    for path in (tmp_path / "records").iterdir():
        path.unlink()
    second = run(SLURM / "hf_roundtrip.sbatch", env | {"TRAIN_ITERS": "1500"}, tmp_path)
    assert second.returncode == 0, second.stderr
    converts = [c["argv"][1:3] for c in records(tmp_path, "zaya-convert")]
    assert converts == [["export-hf", f"{run_dir}/checkpoints"]]
    assert records(tmp_path, "zaya-convert")[0]["argv"][3] == f"{run_dir}/hf-iter1500"
    for call in records(tmp_path, "zaya-torchrun"):
        assert call["argv"][-2:] == ["--load", f"{run_dir}/checkpoints"]


# --- preprocess_data.sbatch --------------------------------------------------------------------


def preprocess_env(tmp_path: Path, task: int) -> dict[str, str]:
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    for name in ("web.jsonl.gz", "Code.txt", "books.jsonl"):
        (raw / name).write_text("{}\n")
    (tmp_path / "tokenizer").mkdir(exist_ok=True)
    return slurm_job_env(tmp_path, ZAYA_PLATFORM="mi300x", INPUTS=f"{raw}/*", OUTPUT_DIR=tmp_path / "out",
                         TOKENIZER=tmp_path / "tokenizer", CONTAINER_IMAGE="img.sqsh",
                         SLURM_ARRAY_JOB_ID=70, SLURM_ARRAY_TASK_ID=task, SLURM_CPUS_PER_TASK=32)


def test_preprocess_array_task_takes_its_file_in_sorted_order(tmp_path):
    proc = run(SLURM / "preprocess_data.sbatch", preprocess_env(tmp_path, 2), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = records(tmp_path, "zaya-preprocess")
    raw, out = tmp_path / "raw", tmp_path / "out"
    # C-locale order: Code.txt, books.jsonl, web.jsonl.gz
    assert call["argv"][1:] == [f"{raw}/web.jsonl.gz", "--output-prefix", f"{out}/web",
                                "--tokenizer", str(tmp_path / "tokenizer"), "--workers", "32"]
    (srun,) = records(tmp_path, "srun")
    assert srun["options"]["output"] == f"{out}/logs/preprocess-70_2.log"
    assert f"{raw}/web.jsonl.gz:{raw}/web.jsonl.gz" in srun["options"]["container-mounts"].split(",")


def test_preprocess_array_task_skips_a_finished_output(tmp_path):
    env = preprocess_env(tmp_path, 0)
    (tmp_path / "out").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / f"out/Code{suffix}").write_bytes(b"")
    proc = run(SLURM / "preprocess_data.sbatch", env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exist already" in proc.stdout and not records(tmp_path, "zaya-preprocess")


def test_preprocess_array_task_beyond_the_inputs_says_which_array_to_submit(tmp_path):
    proc = run(SLURM / "preprocess_data.sbatch", preprocess_env(tmp_path, 3), tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == "error: array task 3 has no input: INPUTS matches 3 files; submit with --array=0-2\n"


def test_submit_pipeline_chains_preprocessing_and_pretraining(tmp_path):
    env = preprocess_env(tmp_path, 0) | {"RUN_DIR": str(tmp_path / "run")}
    proc = subprocess.run(["bash", str(SLURM / "submit_pipeline.sh"), "--nodes=16", "--partition=gpu"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "preprocessing: job 1001 (3 array tasks); pretraining: job 1002\n"
    preprocess, pretrain = records(tmp_path, "sbatch")
    assert preprocess["argv"][1:] == ["--parsable", "--array=0-2", str(SLURM / "preprocess_data.sbatch")]
    assert pretrain["argv"][1:] == ["--parsable", "--dependency=afterok:1001", "--nodes=16", "--partition=gpu",
                                    str(SLURM / "pretrain_zaya1_8b.sbatch")]
    out = tmp_path / "out"
    assert pretrain["env"]["DATA_PATH"] == f"{out}/Code {out}/books {out}/web"  # array-task order
    assert preprocess["env"]["ZAYA_REPO"] == pretrain["env"]["ZAYA_REPO"] == str(REPO)


# --- examples/pretrain.sh (one node) -----------------------------------------------------------


@pytest.mark.parametrize(
    "settings, nproc, model_args",
    [
        ({"MODEL": "tiny"}, 1, []),
        (
            {"MODEL": "zaya1-8b-shallow", "NGPUS": "8"}, 8,
            ["--seq-length", "4096", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "50",
             "--lr", "4e-4", "--min-lr", "4e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--bf16",
             "--use-distributed-optimizer", "--log-interval", "1", "--log-throughput", "--save-interval", "50",
             "--mock-data"],
        ),
        (
            {"MODEL": "zaya1-8b", "NGPUS": "8", "ZAYA_PLATFORM": "h100", "DATA_PATH": "/d/web", "TOKENIZER": "/t"}, 8,
            [*H100_RECOMPUTE, "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--train-iters", "50", "--lr", "4e-4", "--min-lr", "4e-5", "--lr-decay-style", "cosine",
             "--lr-warmup-iters", "10", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
             "--log-throughput", "--save-interval", "50", "--data-path", "/d/web",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/t"],
        ),
    ],
)
def test_one_node_pretrain_script_runs_torchrun_standalone(tmp_path, settings, nproc, model_args):
    env = base_env(tmp_path, **({"ZAYA_PLATFORM": "h200"} | settings))
    proc = run(REPO / "examples/pretrain.sh", env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = records(tmp_path, "zaya-torchrun")
    run_dir = f"runs/{settings['MODEL']}"
    assert call["argv"][1:] == [
        "--standalone", f"--nproc-per-node={nproc}", "--no-python", "zaya-pretrain",
        "--zaya-preset", settings["MODEL"], *model_args,
        "--save", f"{run_dir}/checkpoints", "--load", f"{run_dir}/checkpoints", "--ckpt-format", "torch_dist",
        "--tensorboard-dir", f"{run_dir}/tensorboard",
    ]
    platform_env = PLATFORM_ENV[env["ZAYA_PLATFORM"]]
    assert {k: call["env"].get(k) for k in platform_env} == platform_env


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"MODEL": "zaya1-8b"}, "error: zaya1-8b needs ~160 GB on one GPU and h200 has 141 GiB; "
                                "use NGPUS=8 or MODEL=zaya1-8b-shallow\n"),
        ({"MODEL": "gpt2"}, "error: MODEL=gpt2 must be tiny, zaya1-8b-shallow or zaya1-8b\n"),
        ({"NGPUS": "9"}, "error: NGPUS=9 must be between 1 and GPUS_PER_NODE=8\n"),
    ],
)
def test_one_node_pretrain_script_rejects_what_cannot_run(tmp_path, settings, message):
    proc = run(REPO / "examples/pretrain.sh", base_env(tmp_path, ZAYA_PLATFORM="h200", **settings), tmp_path)
    assert proc.returncode == 1 and proc.stderr == message
    assert not records(tmp_path, "zaya-torchrun")


def test_full_model_on_one_large_gpu_uses_micro_batch_one(tmp_path):
    proc = run(REPO / "examples/pretrain.sh", base_env(tmp_path, ZAYA_PLATFORM="mi300x", MODEL="zaya1-8b"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = records(tmp_path, "zaya-torchrun")
    argv = call["argv"]
    assert argv[argv.index("--micro-batch-size") + 1] == "1" and "--nproc-per-node=1" in argv


# --- zaya1_stage*.sbatch: ZAYA1's schedule over pretrain_zaya1_8b.sbatch ---------------------------------------

STAGE_FLAGS = {  # script -> (seq, global batch, {platform: micro-batch}, flags it adds)
    "zaya1_stage1_4k.sbatch": ("4096", "4096", {"h200": "4", "mi300x": "8"}, [
        "--rotary-base", "10000", "--overlap-grad-reduce", "--clip-grad", "2.0", "--zaya-expert-clip-grad", "1.0",
        "--zaya-router-freeze-tokens", "1000000000", "--zaya-balancing-warmup-steps", "1000"]),
    "zaya1_stage2_32k.sbatch": ("32768", "512", {"h200": "1", "mi300x": "2"}, [
        "--rotary-base", "1000000", "--zaya-allow-rotary-base-change", "--context-parallel-size", "2",
        "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--overlap-grad-reduce", "--clip-grad",
        "2.0", "--zaya-expert-clip-grad", "1.0", "--override-opt_param-scheduler", "--lr-decay-style", "constant"]),
    "zaya1_stage3_128k.sbatch": ("131072", "128", {"h200": "2", "mi300x": "2"}, [
        "--rotary-base", "1000000", "--context-parallel-size", "8", "--expert-model-parallel-size", "2",
        "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--overlap-grad-reduce", "--clip-grad",
        "2.0", "--zaya-expert-clip-grad", "1.0", "--override-opt_param-scheduler", "--lr-decay-style", "constant"]),
}


def stage_command(tmp_path: Path, script: str, platform: str, **extra) -> tuple[subprocess.CompletedProcess, list]:
    """Run a stage script as a 2-node job; its node-0 zaya-pretrain arguments."""
    env, run_dir, _, _ = pretrain_job(tmp_path, platform, EXTRA_ARGS="--wandb-project zaya1", **extra)
    proc = run(SLURM / script, env, tmp_path)
    calls = by_node(records(tmp_path, "zaya-torchrun"))
    return proc, calls[0]["argv"][calls[0]["argv"].index("zaya-pretrain") + 1:] if calls else []


@pytest.mark.parametrize("platform", ["h200", "mi300x"])
def test_stage_scripts_run_the_pretrain_job_with_their_flags(tmp_path, platform):
    previous = tmp_path / "previous/checkpoints"
    for script, (seq, batch, micro, flags) in STAGE_FLAGS.items():
        first = script == "zaya1_stage1_4k.sbatch"
        proc, argv = stage_command(tmp_path / script, script, platform, **({} if first else {"INIT_FROM": previous}))
        assert proc.returncode == 0, proc.stderr
        value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
        assert (value("--seq-length"), value("--global-batch-size"), value("--micro-batch-size")) == (
            seq, batch, micro[platform])
        if script == "zaya1_stage3_128k.sbatch" and platform == "h200":
            flags = flags[:9] + ["--recompute-granularity", "selective"] + flags[9:]
        stage = argv[argv.index("--eval-iters") + 2:argv.index("--wandb-project")]  # after the shared flags
        assert stage == flags
        assert value("--load") == str(tmp_path / script / "run/checkpoints" if first else previous)


def test_a_stage_resumes_its_own_checkpoint_once_it_has_one(tmp_path):
    own = tmp_path / "run/checkpoints"
    own.mkdir(parents=True)
    (own / "latest_checkpointed_iteration.txt").write_text("715100")
    proc, argv = stage_command(tmp_path, "zaya1_stage2_32k.sbatch", "h200", INIT_FROM=tmp_path / "stage1")
    assert proc.returncode == 0, proc.stderr
    assert argv[argv.index("--load") + 1] == str(own)
    proc, _ = stage_command(tmp_path / "missing", "zaya1_stage3_128k.sbatch", "h200")
    assert proc.returncode != 0 and "set INIT_FROM to the checkpoints of stage 2" in proc.stderr


# --- the flags parse in zaya-pretrain ----------------------------------------------------------

PARSE_WITH_ZAYA_PRETRAIN = """
import json, sys
from megatron.training.arguments import parse_args
from megatron_zaya.patches import apply_patches
from megatron_zaya.training.command import build_argv
from megatron_zaya.training.arguments import add_zaya_args
apply_patches(None)
parsed = []
for argv in json.loads(sys.stdin.read()):
    sys.argv = ["zaya-pretrain", *build_argv(argv, cuda=True)]
    args = parse_args(add_zaya_args)
    parsed.append({k: getattr(args, k) for k in ("num_layers", "micro_batch_size", "data_path", "load", "finetune",
                                                  "exit_signal_handler", "mock_data")})
print(json.dumps(parsed))
"""


def test_every_generated_command_line_parses_in_zaya_pretrain(tmp_path):
    """The scripts' flags exist in zaya-pretrain (Megatron's parser plus --zaya-*), not only in our tests.

    OPTIMIZER=adam: Megatron's parser does not list zaya_muon among --optimizer's choices yet.
    """
    command_lines = []
    env, run_dir, data, _ = pretrain_job(tmp_path / "job", "h100", OPTIMIZER="adam")
    assert run(SLURM / "pretrain_zaya1_8b.sbatch", env, tmp_path / "job").returncode == 0
    hf_model = tmp_path / "roundtrip/hf"
    hf_model.mkdir(parents=True)
    env = slurm_job_env(tmp_path / "roundtrip", ZAYA_PLATFORM="mi300x", HF_MODEL=hf_model,
                        RUN_DIR=tmp_path / "roundtrip/run", DATA_PATH="/d/web", OPTIMIZER="adam",
                        CONTAINER_RUNTIME="none")
    assert run(SLURM / "hf_roundtrip.sbatch", env, tmp_path / "roundtrip").returncode == 0
    for model in ("tiny", "zaya1-8b-shallow"):
        one_node = tmp_path / model
        one_node.mkdir()
        assert run(REPO / "examples/pretrain.sh", base_env(one_node, ZAYA_PLATFORM="h200", MODEL=model),
                   one_node).returncode == 0
    for job in ("job", "roundtrip", "tiny", "zaya1-8b-shallow"):
        call = records(tmp_path / job, "zaya-torchrun")[0]["argv"]
        command_lines.append(call[call.index("zaya-pretrain") + 1:])
    for script in STAGE_FLAGS:
        command_lines.append(stage_command(tmp_path / script, script, "h200", OPTIMIZER="adam", INIT_FROM="/c")[1])

    proc = subprocess.run([sys.executable, "-c", PARSE_WITH_ZAYA_PRETRAIN], input=json.dumps(command_lines),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job, roundtrip, tiny, shallow, *stages = json.loads(proc.stdout.splitlines()[-1])
    assert [stage["micro_batch_size"] for stage in stages] == [4, 1, 2] and stages[1]["load"] == "/c"
    assert job | {"data_path": None} == {"num_layers": 40, "micro_batch_size": 1, "data_path": None,
                                         "load": f"{run_dir}/checkpoints", "finetune": False,
                                         "exit_signal_handler": True, "mock_data": False}
    assert job["data_path"] == data
    assert roundtrip["load"] == f"{tmp_path}/roundtrip/run/imported" and roundtrip["finetune"]
    assert tiny["num_layers"] == 4 and tiny["load"] == "runs/tiny/checkpoints"
    assert shallow["num_layers"] == 8 and shallow["micro_batch_size"] == 2 and shallow["mock_data"]
