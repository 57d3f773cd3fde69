"""The build step pyproject.toml (metadata, dependencies, extras, the CLI) cannot say: a built wheel carries the
top-level `kernels/` folder as `megatron_search.kernels` and `configs/` as `megatron_search/_data/configs`."""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """A built wheel holds the top-level kernels/ folder's modules inside megatron_search/kernels/, and configs/
    (the shipped run configs and model configs) inside megatron_search/_data/ (config.model.data_root finds it).

    kernels/ has no __init__.py (it would shadow Hugging Face's `kernels` package from the checkout's
    root); megatron_search/kernels/__init__.py adds that folder to its path in a checkout instead."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install imports from the checkout itself
            return
        target = Path(self.build_lib, "megatron_search", "kernels")
        for source in sorted(Path("kernels").glob("*.py")):
            self.copy_file(str(source), str(target / source.name))
        data = Path(self.build_lib, "megatron_search", "_data")
        for source in sorted(p for p in Path("configs").rglob("*") if p.is_file()):
            self.mkpath(str((data / source).parent))
            self.copy_file(str(source), str(data / source))

setup(cmdclass={"build_py": BuildPyWithKernels})
