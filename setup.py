"""Install megatron-search: the library, `kernels/` as `megatron_search.kernels`, and the CLI."""
from setuptools import find_packages, setup

packages = find_packages(include=["megatron_search", "megatron_search.*"])
packages += ["megatron_search.kernels"] + [
    "megatron_search.kernels." + p for p in find_packages(where="kernels")
]

setup(
    name="megatron-search",
    version="0.1.0",
    description="Megatron-Core stack that post-trains Qwen MoE policies into web-search agents (SFT + GRPO).",
    python_requires=">=3.11",
    packages=packages,
    package_dir={"megatron_search.kernels": "kernels"},
    include_package_data=True,
    package_data={"megatron_search": ["**/*.txt", "**/*.md", "**/*.json", "**/*.yaml"]},
    install_requires=[
        # Floors, not ceilings: megatron-core 0.16.1 is the newest for Python 3.11; newer must work.
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "transformers>=5.2",  # qwen3_5_moe arrived in 5.2.0
        "safetensors>=0.4",
        "pydantic>=2.6",
        "PyYAML>=6.0",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "numpy>=1.26",
        "einops>=0.7",
        "bm25s>=0.2",
        "tiktoken>=0.7",
        "tokenizers>=0.19",
        "aiohttp>=3.9",
        "matplotlib>=3.8",
        "lingua-language-detector>=2.0",
        "pyarrow>=15",  # parquet / Arrow datasets; datasets 4.0 needs >= 15
        # every dataset path (files, Hub-layout and save_to_disk folders) is read through it, offline
        # (data/hf_datasets.py); 4.0.0 and 5.2.0 tested. It needs no torch (only its [torch] extra would).
        "datasets>=4.0",
        "psutil>=5.9",  # megatron.core.dist_checkpointing's file writer needs it (weights/checkpoint.py)
    ],
    extras_require={
        # triton>=3.7.1: fla's GDN chunk backward is wrong on Hopper with Triton 3.4-3.7.0 (fla #640;
        # fla 0.6 refuses it; seen on an H200 with Triton 3.6, tools/gpu_selfcheck.py).
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.9", "flash-linear-attention>=0.3", "triton>=3.7.1"],
        # Tests also need qwen-agent for its Qwen BPE ranks file, installed without its (unused)
        # runtime dependencies by scripts/install.sh --dev: pip install --no-deps "qwen-agent>=0.0.30";
        # and sglang 0.5.23's pure-Python modules for the contract tests (--no-deps, plus
        # scripts/sglang-contract-requirements.txt).
        "dev": ["pytest>=8", "hypothesis>=6.100", "triton>=3.0"],
    },
    entry_points={"console_scripts": ["megatron-search=megatron_search.cli:main"]},
)
