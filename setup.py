"""Install megatron-search: the library, `kernels/` as `megatron_search.kernels`, and the CLI.

Versions: floors here, ceilings on the fast movers whose private APIs we use; what an install actually
gets is pinned by requirements/lock.txt (scripts/install.sh installs through it; `make lock` moves it)."""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """A built wheel holds the top-level kernels/ folder's modules inside megatron_search/kernels/.

    kernels/ has no __init__.py (it would shadow Hugging Face's `kernels` package from the checkout's
    root); megatron_search/kernels/__init__.py adds that folder to its path in a checkout instead."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install imports from the checkout itself
            return
        target = Path(self.build_lib, "megatron_search", "kernels")
        for source in sorted(Path("kernels").glob("*.py")):
            self.copy_file(str(source), str(target / source.name))

setup(
    name="megatron-search",
    version="0.1.0",
    description="Megatron-Core stack that post-trains Qwen MoE policies into web-search agents (SFT + GRPO).",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_search", "megatron_search.*"]),
    cmdclass={"build_py": BuildPyWithKernels},
    include_package_data=True,
    package_data={"megatron_search": ["**/*.txt", "**/*.md", "**/*.json", "**/*.yaml"]},
    install_requires=[
        # Floors, and ceilings at the next minor (0.x) or major release on the packages whose private
        # APIs we use: megatron-core 0.16.1 is the newest for Python 3.11 (0.17 needs 3.12, untested).
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17",
        "transformers>=5.2,<6",  # qwen3_5_moe arrived in 5.2.0
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
        "datasets>=4.0,<6",
        "psutil>=5.9",  # megatron.core.dist_checkpointing's file writer needs it (weights/checkpoint.py)
    ],
    extras_require={
        # triton>=3.7.1: fla's GDN chunk backward is wrong on Hopper with Triton 3.4-3.7.0 (fla #640;
        # fla 0.6 refuses it; seen on an H200 with Triton 3.6, tools/gpu_selfcheck.py).
        "gpu": ["transformer-engine[pytorch]", "sglang>=0.5.9", "flash-linear-attention>=0.3", "triton>=3.7.1"],
        # Tests also need qwen-agent for its Qwen BPE ranks file, installed without its (unused)
        # runtime dependencies by scripts/install.sh --dev: pip install --no-deps "qwen-agent>=0.0.30";
        # sglang 0.5.23's pure-Python modules for the contract tests go into .cache/, not the environment
        # (scripts/fetch_sglang_contract.sh, pinned by requirements/sglang-contract.lock.txt).
        "dev": ["pytest>=8", "hypothesis>=6.100", "triton>=3.0"],
    },
    entry_points={"console_scripts": ["megatron-search=megatron_search.cli:main"]},
)
