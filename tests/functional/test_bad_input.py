"""zaya-pretrain on bad input: exit 2 with one line naming the problem and the fix, before Megatron builds
anything, no traceback, nothing written. All cases run in one process (one start-up) through ``main``, each
in a directory of its own and with Megatron's global state reset between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from shared import once
from zaya_cli import QUICK

from megatron_zaya.data import embedded_tokenizer_dir
from megatron_zaya.data.preprocess import write_indexed_dataset

RUNNER = """
import contextlib, io, json, os, sys
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.training.global_vars import destroy_global_vars
from megatron_zaya.pretrain import main
results = {}
for i, (name, argv) in enumerate(json.loads(sys.argv[1]).items()):
    os.makedirs(f"case{i}")
    os.chdir(f"case{i}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results[name] = [code, out.getvalue(), err.getvalue(), sorted(os.listdir("."))]
    destroy_global_vars()  # as a new process would start: a case that failed after Megatron's parsing set them
    destroy_num_microbatches_calculator()
    os.chdir("..")
print(json.dumps(results))
"""


def _corpus(directory, name, documents):
    source = directory / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"text": f"Document {i}. " + "A truth universally acknowledged. " * 30})
                              + "\n" for i in range(documents)))
    prefix = str(directory / name)
    write_indexed_dataset([str(source)], prefix, embedded_tokenizer_dir(), progress=False)
    return prefix


def _damage_a_middle_pointer(prefix):
    """Overwrite the byte offset of the middle sequence in the .idx (header, lengths, then the pointers)."""
    idx = prefix + ".idx"
    sequences = int(np.frombuffer(open(idx, "rb").read(34)[18:26], np.uint64)[0])
    pointers = np.memmap(idx, np.int64, "r+", 34 + 4 * sequences, (sequences,))
    pointers[sequences // 2] += 4096
    pointers.flush()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``{case: [exit code, stdout, stderr, files written]}``, from one process that every worker shares."""
    return json.loads((once(tmp_path_factory, "bad-input", _run_cases) / "results.json").read_text())


def _run_cases(directory):
    small = _corpus(directory, "small", 20)  # 20 documents: the default --split's 0.1% test share is empty
    damaged = _corpus(directory, "damaged", 20)
    _damage_a_middle_pointer(damaged)
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", embedded_tokenizer_dir()]
    held = directory / "held"  # a --save directory holding the checkpoint of a run
    (held / "iter_0000003").mkdir(parents=True)
    (held / "latest_checkpointed_iteration.txt").write_text("3")
    other = directory / "other"  # the checkpoint of another run
    (other / "iter_0000002").mkdir(parents=True)
    (other / "latest_checkpointed_iteration.txt").write_text("2")
    hugging_face = directory / "ZAYA1-8B"  # what zaya-convert import-hf reads
    hugging_face.mkdir()
    (hugging_face / "config.json").write_text('{"model_type": "zaya"}')
    (hugging_face / "model.safetensors").write_bytes(b"")
    (directory / "empty").mkdir()
    cases = {
        "small corpus with the default split": ["--data-path", small, *tokenizer],
        "a damaged pointer in the middle of the .idx": ["--data-path", damaged, "--split", "90,10,0", *tokenizer],
        "data without a tokenizer": ["--data-path", small, "--split", "90,10,0"],
        "a tokenizer path that does not exist": ["--data-path", small, "--split", "90,10,0", "--tokenizer-type",
                                                 "HuggingFaceTokenizer", "--tokenizer-model", "./my-tokenizer"],
        "mock data and a data path": ["--mock-data", "--data-path", small, *tokenizer],
        "a tokenizer that does not load": ["--data-path", small, "--split", "90,10,0", "--save-interval", "5",
                                           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                           str(directory)],
    }
    mock = ["--mock-data", "--zaya-preset", "test"]
    cases.update({
        "negative learning rate": [*mock, "--lr", "-0.001"],
        "micro-batch size 0": [*mock, "--micro-batch-size", "0"],
        "no checkpoint writer threads": [*mock, "--async-save", "--dist-ckpt-workers", "0"],
        "bf16 and fp16": [*mock, "--bf16", "--fp16"],
        "a global batch no multiple of the micro-batch": [*mock, "--micro-batch-size", "2", "--global-batch-size",
                                                          "3"],
        "two run lengths": [*mock, "--train-samples", "40"],
        "CUDA graphs on CPU": [*mock, "--zaya-cuda-graphs"],
        "balancing a skip class that is off": [*mock, "--zaya-no-skip-class", "--zaya-balance-skip-class"],
        "a misspelt flag": [*mock, "--lrr", "3"],
        "an unknown patch": [*mock, "--zaya-patches", "bogus"],
        "no patches on a CPU": [*mock, "--zaya-patches", "none"],
        "a negative SIGTERM deadline": [*mock, "--zaya-sigterm-deadline", "-5"],
        "a negative watchdog": [*mock, "--zaya-watchdog-seconds", "-1"],
        "a negative step-failure limit": [*mock, "--zaya-max-step-failures", "-1"],
        "skipping failing steps without a limit": [*mock, "--zaya-skip-failing-steps", "--zaya-max-step-failures",
                                                   "0"],
        "a negative balancing warm-up": [*mock, "--zaya-balancing-warmup-steps", "-3"],
        "a negative garbage-collection interval": [*mock, "--zaya-gc-interval", "-1"],
        "a negative router freeze": [*mock, "--zaya-router-freeze-tokens", "-1000"],
        "an expert clip without the optim patches": [*mock, "--save-interval", "5", "--zaya-patches", "cpu",
                                                     "--zaya-expert-clip-grad", "1"],
        "a local tier without a directory": [*mock, "--non-persistent-ckpt-type", "local",
                                             "--non-persistent-save-interval", "2"],
        "a local tier without an interval": [*mock, "--non-persistent-ckpt-type", "local",
                                             "--non-persistent-local-ckpt-dir", "local"],
        "a non-persistent interval without a tier": [*mock, "--non-persistent-save-interval", "2"],
        "a local tier with replication": [*mock, "--non-persistent-ckpt-type", "local", "--replication",
                                          "--non-persistent-local-ckpt-dir", "local",
                                          "--non-persistent-save-interval", "2"],
        "an unwritable local tier": [*mock, "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval",
                                     "2", "--non-persistent-local-ckpt-dir", str(directory / "small.bin" / "local")],
        "a background save of another format": [*mock, "--async-save", "--ckpt-format", "torch"],
        "a background save through a missing package": [*mock, "--async-save", "--async-strategy", "nvrx"],
        "a background save beside a shared gradient buffer": [*mock, "--async-save",
                                                              "--reuse-grad-buf-for-mxfp8-param-ag"],
        "Transformer Engine attention without the package": [*mock, "--zaya-core-attention", "te"],
        "the moe op without its kernels": [*mock, "--save-interval", "5", "--zaya-kernels", "experts,moe"],
        "the cca_sublayer op without its kernels": [*mock, "--save-interval", "5", "--zaya-kernels", "cca_sublayer"],
        "Megatron's vocabulary flag": [*mock, "--vocab-size", "4096"],
        "no layers": [*mock, "--num-layers", "0"],
        "no attention heads": [*mock, "--num-attention-heads", "0"],
        "a model vocabulary of 0": [*mock, "--zaya-vocab-size", "0"],
        "a log interval of 0": [*mock, "--log-interval", "0"],
        "an expert-parallel size of 0": [*mock, "--expert-model-parallel-size", "0"],
        "a negative gradient clip": [*mock, "--clip-grad", "-1"],
        "a dropout above 1": [*mock, "--hidden-dropout", "1.5"],
        "an Adam beta of 1": [*mock, "--adam-beta2", "1"],
        "uniform recomputation of no layers": [*mock, "--recompute-granularity", "full", "--recompute-method",
                                               "uniform", "--recompute-num-layers", "0"],
        "a router of no width": [*mock, "--save-interval", "5", "--zaya-router-hidden-size", "0"],
        "balancing betas above 1": [*mock, "--save-interval", "5", "--zaya-balancing-betas", "0.9", "1.5"],
        "a Muon momentum of 1": [*mock, "--save-interval", "5", "--optimizer", "zaya_muon", "--zaya-muon-momentum",
                                 "1"],
        "a negative Muon update RMS": [*mock, "--save-interval", "5", "--optimizer", "zaya_muon",
                                       "--zaya-muon-update-rms", "-0.2"],
        "a save without an interval": mock,
    })
    saving = [*mock, "--save-interval", "5"]
    memory = [*saving, "--save", "ck", "--zaya-memory-ckpt-interval", "2", "--zaya-memory-ckpt-dir", "mem"]
    cases.update({
        "an in-memory tier larger than the node's memory": [*memory, "--zaya-memory-ckpt-keep", "100000000"],
        "an in-memory tier beside a local tier": [*memory, "--non-persistent-ckpt-type", "local",
                                                  "--non-persistent-local-ckpt-dir", "local"],
        "an in-memory tier without gloo groups": [*memory, "--disable-gloo-process-groups"],
        "a --load that does not exist": [*saving, "--load", "missing-ckpt"],
        "another --load into a --save that holds a checkpoint": [*saving, "--save", str(held), "--load",
                                                                 str(other)],
        "--finetune into a --save that holds a checkpoint": [*saving, "--save", str(held), "--load", str(held),
                                                             "--finetune"],
        "overwriting the checkpoint it loads": [*saving, "--save", str(held), "--load", str(held),
                                                "--zaya-overwrite-save"],
        "a Hugging Face checkpoint as --load": [*saving, "--save", "tuned", "--load", str(hugging_face),
                                                "--finetune"],
        "a step directory as --load": [*saving, "--save", "next", "--load", str(held / "iter_0000003")],
        "an empty --load": [*saving, "--save", "next", "--load", str(directory / "empty")],
        "--finetune from an empty --save": [*saving, "--save", str(directory / "empty"), "--load",
                                            str(directory / "empty"), "--finetune"],
    })
    cases.update({name: flags for name, (flags, _) in MODEL_AND_LAYOUT.items()})
    argvs = {name: QUICK + ["--train-iters", "5", "--save", "ckpt", "--load", "ckpt", *flags]
             for name, flags in cases.items()}
    argvs["--help"] = ["--help"]
    # Whole command lines: without the settings QUICK gives.
    argvs["no micro-batch size"] = ["--mock-data", "--zaya-preset", "tiny", "--seq-length", "64", "--train-iters", "4"]
    argvs["no sequence length"] = ["--mock-data", "--zaya-preset", "tiny", "--micro-batch-size", "2", "--train-iters",
                                   "4"]
    argvs["no run length"] = ["--mock-data", "--zaya-preset", "tiny", "--micro-batch-size", "2", "--seq-length", "64"]
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argvs)], cwd=directory, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    (directory / "results.json").write_text(run.stdout.strip().splitlines()[-1])


# Bad model, layout and schedule flags on the embedded corpus: case -> (flags, words the error line must hold)
MODEL_AND_LAYOUT = {
    "unknown preset": (["--zaya-preset", "zaya9"], ["unknown preset", "zaya9"]),
    "missing data": (["--data-path", "/nonexistent/corpus_text_document", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "4095"], ["/nonexistent/corpus_text_document", "zaya-preprocess"]),
    "sequence too long": (["--seq-length", "4096"], ["--seq-length 4096", "--max-position-embeddings 1024"]),
    "parallel sizes": (["--tensor-model-parallel-size", "3"], ["not divisible", "TP*PP*CP"]),
    "context parallel chunks": (["--context-parallel-size", "3"], ["--seq-length 64", "2*CP = 6"]),
    "tokenizer too large": (["--zaya-vocab-size", "1024"], ["4096 tokens", "1024"]),
    "save without interval": (["--mock-data", "--zaya-preset", "test", "--save-interval", "0"],
                              ["assert args.save_interval"]),
    "min lr above lr": (["--lr", "1e-4"], ["--min-lr 0.0003", "--lr 0.0001"]),
    "warmup too long": (["--lr-warmup-iters", "5"], ["--lr-warmup-iters 5", "decay length 5"]),
    "cuda graphs and overlapped gather": (["--zaya-cuda-graphs", "--use-distributed-optimizer",
                                           "--overlap-param-gather", "--overlap-grad-reduce"],
                                          ["--zaya-cuda-graphs", "--overlap-param-gather"]),
    "pipeline stages": (["--pipeline-model-parallel-size", "3"],
                        ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    "document mask without position ids": (["--reset-attention-mask"], ["--reset-position-ids", "together"]),
}

EXPECTED = {  # case -> words the one error line must hold
    "small corpus with the default split": ["the test split", "(20 sequences) with 0 sequences",
                                            "--split 96.9,3,0"],
    "a damaged pointer in the middle of the .idx": ["damaged.idx", "sequence 10 of 20", "zaya-preprocess"],
    "data without a tokenizer": ["--data-path needs the tokenizer", "--tokenizer-model"],
    "a tokenizer path that does not exist": ["--tokenizer-model ./my-tokenizer: no such directory"],
    "a tokenizer that does not load": ["does not load", "give the tokenizer's directory"],
    "negative learning rate": ["--lr -0.001 is negative"],
    "micro-batch size 0": ["--micro-batch-size 0: must be at least 1"],
    "no checkpoint writer threads": ["--dist-ckpt-workers 0: must be at least 1"],
    "no micro-batch size": ["invalid arguments: --micro-batch-size is missing; give it (Megatron's check "
                            "`assert args.micro_batch_size is not None` failed)"],
    "no sequence length": ["invalid arguments: --seq-length is missing; give it (Megatron's check "
                           "`assert args.encoder_seq_length is not None` failed)"],
    "bf16 and fp16": ["--bf16 and --fp16", "choose one"],
    "no run length": ["the run has no length: give --train-iters N (or --train-samples N)"],
    "two run lengths": ["--train-iters 5 and --train-samples 40 both give the run's length; keep one"],
    "a global batch no multiple of the micro-batch": ["--global-batch-size 3 is not a multiple of --micro-batch-size "
                                                      "2 x the data-parallel size 1; give a multiple of 2, e.g. 4"],
    "mock data and a data path": ["--mock-data and --data-path", "drop --mock-data"],
    "CUDA graphs on CPU": ["--zaya-cuda-graphs needs a GPU"],
    "balancing a skip class that is off": ["--zaya-balance-skip-class with --zaya-no-skip-class"],
    "a misspelt flag": ["unrecognized arguments: --lrr 3"],
    "an unknown patch": ["unknown patch or group 'bogus' in --zaya-patches", "known: all, none,"],
    "no patches on a CPU": ["--zaya-patches none leaves out", "patches of the cpu group (cpu.current_device,",
                            "add cpu to the selection, or give all"],
    "a negative SIGTERM deadline": ["--zaya-sigterm-deadline -5 is negative", "0 to turn it off"],
    "a negative watchdog": ["--zaya-watchdog-seconds -1 is negative", "0 to turn the watchdog off"],
    "a negative step-failure limit": ["--zaya-max-step-failures -1 is negative", "0 to never stop"],
    "skipping failing steps without a limit": ["--zaya-skip-failing-steps needs --save", "above 0",
                                               "drop --zaya-skip-failing-steps"],
    "a negative balancing warm-up": ["--zaya-balancing-warmup-steps -3 is negative", "0: no warm-up"],
    "a negative garbage-collection interval": ["--zaya-gc-interval -1 is negative", "0: Python's automatic collector"],
    "a negative router freeze": ["--zaya-router-freeze-tokens -1000 is negative", "0 to turn it off"],
    "an expert clip without the optim patches": ["--zaya-expert-clip-grad act through the optim.zaya_muon patch",
                                                 "add it to --zaya-patches"],
    "a local tier without a directory": ["needs --non-persistent-local-ckpt-dir DIR"],
    "a local tier without an interval": ["every --non-persistent-save-interval N steps; give N"],
    "a non-persistent interval without a tier": ["needs --non-persistent-ckpt-type local"],
    "a local tier with replication": ["--replication does not work with --non-persistent-ckpt-type local"],
    "an unwritable local tier": ["small.bin/local is not writable"],
    "an in-memory tier larger than the node's memory": ["the in-memory tier needs", "GiB free",
                                                         "lower --zaya-memory-ckpt-keep"],
    "an in-memory tier beside a local tier": ["--zaya-memory-ckpt-interval is Megatron's local non-persistent",
                                              "drop --non-persistent-ckpt-type"],
    "a background save of another format": ["--async-save writes --ckpt-format torch_dist only, not torch"],
    "a background save through a missing package": ["--async-strategy nvrx needs", "drop the flag"],
    "a background save beside a shared gradient buffer": ["--reuse-grad-buf-for-mxfp8-param-ag does not work with "
                                                          "--async-save"],
    "Transformer Engine attention without the package": ["--zaya-core-attention te needs Transformer Engine",
                                                          "--zaya-core-attention sdpa"],
    "the moe op without its kernels": ["the moe kernel op composes the router, router_head and experts kernels",
                                       "--zaya-kernels experts,moe,router,router_head"],
    "the cca_sublayer op without its kernels": ["the cca_sublayer kernel op composes the residual and cca kernels",
                                                "--zaya-kernels cca_sublayer,residual,cca"],
    "Megatron's vocabulary flag": ["--vocab-size", "NullTokenizer", "--zaya-vocab-size N"],
    "no layers": ["--num-layers 0: must be at least 1"],
    "no attention heads": ["--num-attention-heads 0: must be at least 1"],
    "a model vocabulary of 0": ["--zaya-vocab-size 0: must be at least 1"],
    "a log interval of 0": ["--log-interval 0: must be at least 1"],
    "an expert-parallel size of 0": ["--expert-model-parallel-size 0: must be at least 1"],
    "a negative gradient clip": ["--clip-grad -1 is negative; give 0 or more (0: no clipping)"],
    "a dropout above 1": ["--hidden-dropout 1.5: must be at least 0 and at most 1"],
    "an Adam beta of 1": ["--adam-beta2 1: must be at least 0 and below 1"],
    "a router of no width": ["--zaya-router-hidden-size 0", "width of at least 1"],
    "balancing betas above 1": ["--zaya-balancing-betas 0.9 1.5", "at least 0 and below 1"],
    "a Muon momentum of 1": ["--zaya-muon-momentum must be in [0, 1), got 1.0"],
    "a negative Muon update RMS": ["--zaya-muon-update-rms must be positive, got -0.2"],
    "a save without an interval": ["--save needs --save-interval N"],
    "a --load that does not exist": ["--load missing-ckpt: no such directory", "drop --load to start afresh"],
    "another --load into a --save that holds a checkpoint": [
        "held holds a checkpoint (iteration 3) of another run, which this run would replace (it loads --load",
        "to resume that run drop --load", "to replace it add --zaya-overwrite-save"],
    "--finetune into a --save that holds a checkpoint": ["--finetune restarts at iteration 0", "drop --finetune"],
    "overwriting the checkpoint it loads": ["--zaya-overwrite-save with --load",
                                            "would delete the checkpoint it loads"],
    "a Hugging Face checkpoint as --load": ["ZAYA1-8B holds a Hugging Face checkpoint, not a Megatron one",
                                            "zaya-convert import-hf", "ZAYA1-8B-megatron"],
    "a step directory as --load": ["iter_0000003 is one step of the checkpoint directory", "held (it loads"],
    "an empty --load": ["empty holds no checkpoint", "drop --load to start afresh"],
    "--finetune from an empty --save": ["empty holds no checkpoint"],
    **{name: words for name, (_, words) in MODEL_AND_LAYOUT.items()},
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_one_line_and_exit_2(case, results):
    code, _, stderr, written = results[case]
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("zaya-pretrain: error:") and all(w in last for w in EXPECTED[case]), last
    if case == "a misspelt flag":  # argparse's usage line and its error, not the list of every flag
        assert len(stderr.strip().splitlines()) == 2, stderr
    assert written == []


def test_help_lists_every_flag_and_writes_nothing(results):
    code, stdout, stderr, written = results["--help"]
    assert code == 0, stderr[-3000:]
    assert "--zaya-sigterm-deadline" in stdout and "90% of data" in stdout and "default 100%" in stdout
    assert written == []


def test_zaya_torchrun_does_not_restart_bad_input_and_exits_2(tmp_path):
    """Under ``--max-restarts 3`` a worker that refuses its flags (exit 2) is not restarted (each restart would refuse
    them again): the error line comes once, and zaya-torchrun exits 2 (torchrun exits 1) for the Slurm scripts to
    leave it to a person instead of requeueing it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-m", "megatron_zaya.launch", "--standalone", "--nproc-per-node", "1",
                          "--max-restarts", "3", "-m", "megatron_zaya.pretrain", *QUICK, "--train-iters", "4",
                          "--num-layers", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("zaya-pretrain: error: --num-layers 0: must be at least 1") == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == "zaya-torchrun: a worker stopped on bad input; not restarted: exit 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
