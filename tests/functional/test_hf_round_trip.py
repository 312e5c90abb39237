"""A Hugging Face ZAYA1 model through the whole tool chain, on CPU:

transformers model -> ``zaya-convert import-hf`` -> the fine-tuning command it prints (5 steps on the embedded
corpus) -> ``zaya-convert export-hf --tokenizer`` -> ``transformers`` ``from_pretrained`` + ``generate``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from zaya_cli import QUICK, losses, pretrain
from zaya_reference import hf_config, random_hf_model

from megatron_zaya import load_pretrained
from megatron_zaya.convert.cli import main as convert
from megatron_zaya.data import embedded_tokenizer_dir

THETA, LR, STEPS = 10_000, 3e-3, 5
# vocab 4096: the embedded tokenizer's, so the model trains on the embedded corpus as it is.
HF = hf_config(vocab_size=4096, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=2, moe_intermediate_size=96, num_experts=4, router_hidden_size=32,
               max_position_embeddings=256,
               rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5}})
PROMPT = "It is a truth universally acknowledged"


def greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by full-sequence forwards (no cache): ``[1, s] -> [1, s + new_tokens]``."""
    for _ in range(new_tokens):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


def test_import_finetune_export_generate(tmp_path, capsys):
    hf_dir, imported, exported = (tmp_path / name for name in ("hf", "imported", "exported"))
    random_hf_model(HF, seed=2).save_pretrained(hf_dir)
    assert convert(["import-hf", str(hf_dir), str(imported)]) == 0
    # The command import-hf prints, as printed: the model's shape in flags, --load, --finetune, --save and its
    # interval; this test shortens the run and raises the learning rate (later flags win).
    command = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert command[:3] == [sys.executable, "-m", "megatron_zaya.pretrain"]
    trained = Path(command[command.index("--save") + 1])

    run = pretrain(command[3:] + QUICK + ["--train-iters", str(STEPS), "--lr", str(LR)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"successfully loaded checkpoint from {imported}" in run.stdout
    assert sorted(losses(run.stdout)) == list(range(1, STEPS + 1))

    assert convert(["export-hf", str(trained), str(exported), "--tokenizer", embedded_tokenizer_dir()]) == 0
    before, after = load_file(hf_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(before) == set(after)
    for key, tensor in before.items():
        change = (after[key] - tensor).abs().max().item()
        # Trained, and from the imported weights: 5 Adam steps at lr <= 3e-3 move a weight by far less than
        # 0.05, while these random weights are O(0.3) away from any fresh initialisation.
        assert 0 < change < 0.05, (key, change)

    tokenizer = AutoTokenizer.from_pretrained(exported)
    hf_model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ours = load_pretrained(trained, device="cpu")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref, logits = hf_model(ids).logits, ours(ids)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-5

    generated = hf_model.generate(ids, max_new_tokens=4, do_sample=False)  # transformers' cached decoding
    assert torch.equal(generated, greedy(ours, ids, 4))
    assert tokenizer.decode(generated[0]).startswith(PROMPT)
