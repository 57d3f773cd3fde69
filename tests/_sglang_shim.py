"""Lets sglang's pure-Python modules import on a CPU-only machine, for the contract tests only.

sglang's import chain reaches `torchvision.transforms` at module level (a multimodal helper and an
OCR config) but only uses it inside functions. PyPI's torchvision wheels for this torch are CUDA
builds that fail to load against the CPU torch, so torchvision is not installed; `install()` puts
three empty modules in its place (plus the InterpolationMode enum those imports name). Call it in
the process that imports sglang, before the first sglang import, and nowhere else.
"""
from __future__ import annotations

import enum
import importlib.machinery
import sys
import types

NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Absent(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__}.{name}: torchvision is not installed (CPU contract-test stand-in)")


def install() -> None:
    if "torchvision" in sys.modules and not isinstance(sys.modules["torchvision"], _Absent):
        return
    # transformers caches is_torchvision_available(): ask it while torchvision is really absent, so
    # it never takes its torchvision code paths because of the stand-in's module spec.
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        raise RuntimeError("a torchvision distribution is installed; the stand-in is only for machines without one")
    mods = {}
    for name in NAMES:
        m = _Absent(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        m.__path__ = []
        mods[name] = m
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    mods["torchvision.transforms"].InterpolationMode = InterpolationMode
    mods["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    sys.modules.update(mods)
