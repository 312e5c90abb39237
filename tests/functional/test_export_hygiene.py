"""zaya-convert's outputs: the permissions of any new directory, only the tokenizer's own files, and a warning
line when an export has no tokenizer."""

from __future__ import annotations

import os
import shutil
import stat

from transformers import AutoTokenizer
from zaya_reference import hf_config, random_hf_model

from megatron_zaya.convert.cli import main as convert
from megatron_zaya.data import embedded_tokenizer_dir

HF = hf_config(vocab_size=4096, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               num_hidden_layers=2, moe_intermediate_size=32, num_experts=2, router_hidden_size=16,
               max_position_embeddings=64)


def _modes(root):
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")] if p.is_dir()}


def test_outputs_have_normal_permissions_and_only_tokenizer_files(tmp_path, capsys):
    umask = os.umask(0o022)
    try:
        hf_dir, imported = tmp_path / "hf", tmp_path / "imported"
        random_hf_model(HF, seed=3).save_pretrained(hf_dir)
        assert convert(["import-hf", str(hf_dir), str(imported)]) == 0
        assert set(_modes(imported).values()) == {0o755}, _modes(imported)

        assert convert(["export-hf", str(imported), str(tmp_path / "bare")]) == 0
        assert set(_modes(tmp_path / "bare").values()) == {0o755}
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert warnings == [f"zaya-convert: warning: {tmp_path / 'bare'} has no tokenizer; export again with "
                            "--tokenizer DIR (the tokenizer the model was trained with) or save that tokenizer "
                            "into it"], warnings

        tokenizer = tmp_path / "tokenizer"  # a tokenizer directory that also holds a corpus and notes
        shutil.copytree(embedded_tokenizer_dir(), tokenizer)
        (tokenizer / "corpus.jsonl").write_text('{"text": "not a tokenizer file"}\n')
        assert convert(["export-hf", str(imported), str(tmp_path / "full"), "--tokenizer", str(tokenizer)]) == 0
        files = {p.name for p in (tmp_path / "full").iterdir()}
        assert not files & {"corpus.jsonl", "austen.jsonl.gz", "README.md"}, files
        assert "tokenizer.json" in files and "model.safetensors" in files
        text = "It is a truth universally acknowledged"
        assert AutoTokenizer.from_pretrained(tmp_path / "full")(text)["input_ids"] == \
            AutoTokenizer.from_pretrained(tokenizer)(text)["input_ids"]
        assert "warning" not in capsys.readouterr().err
    finally:
        os.umask(umask)
