"""Read HF tensors by name, one at a time, from a safetensors checkpoint or an in-memory state dict.

Per-expert names (`mlp.experts.{j}.gate_proj.weight`, what transformers writes and what the
mapping table uses) are also served from fused checkpoints (`mlp.experts.gate_up_proj` [E, 2I, H],
gate first, and `mlp.experts.down_proj` [E, H, I]: the published Qwen3.5 layout, and the layout
transformers 5 keeps in memory) by slicing, so reading one expert never loads the whole layer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import torch
from safetensors import safe_open

_PER_EXPERT = re.compile(r"^(?P<pre>.*mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class HFTensorSource:
    """Name -> tensor reader with fused-expert fallback; `names()` lists what is stored."""

    def __init__(self, getters: Mapping[str, Callable[[], torch.Tensor]],
                 slicers: Mapping[str, Callable[[int, Optional[slice]], torch.Tensor]],
                 shapes: Mapping[str, tuple[int, ...]], where: str):
        self._get = dict(getters)
        self.shapes = dict(shapes)
        self._slice = dict(slicers)
        self.where = where

    # ---- constructors --------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], where: str = "state dict") -> "HFTensorSource":
        getters = {k: (lambda t=t: t) for k, t in sd.items()}
        slicers = {k: (lambda e, rows, t=t: t[e] if rows is None else t[e, rows]) for k, t in sd.items()}
        return cls(getters, slicers, {k: tuple(t.shape) for k, t in sd.items()}, where)

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTensorSource":
        """A directory of *.safetensors (sharded with model.safetensors.index.json or not)."""

        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{root}: no *.safetensors files")
        getters, slicers, shapes = {}, {}, {}
        for fname in files:
            fpath = str(root / fname)
            with safe_open(fpath, "pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
            for k in [k for k in shapes if k not in getters]:
                getters[k] = lambda k=k, fpath=fpath: _read(fpath, k)
                slicers[k] = lambda e, rows, k=k, fpath=fpath: _read_slice(fpath, k, e, rows)
        return cls(getters, slicers, shapes, str(root))

    # ---- access --------------------------------------------------------------------------------
    def names(self) -> set[str]:
        return set(self._get)

    def __contains__(self, name: str) -> bool:
        return name in self._get or self._fused_of(name) is not None

    def stored_name(self, name: str) -> str:
        """The stored tensor that serves `name` (itself, or the fused tensor it is sliced from)."""
        if name in self._get:
            return name
        fused = self._fused_of(name)
        if fused is None:
            raise MissingTensorError(f"{self.where}: tensor {name!r} is missing")
        return fused[0]

    def get(self, name: str) -> torch.Tensor:
        if name in self._get:
            return self._get[name]()
        fused = self._fused_of(name)
        if fused is None:
            raise MissingTensorError(f"{self.where}: tensor {name!r} is missing")
        stored, e, half = fused
        if half is None:
            return self._slice[stored](e, None)
        inter = self.shapes[stored][1] // 2
        rows = slice(0, inter) if half == 0 else slice(inter, 2 * inter)
        return self._slice[stored](e, rows)

    def _fused_of(self, name: str):
        m = _PER_EXPERT.match(name)
        if not m:
            return None
        pre, e, proj = m.group("pre"), int(m.group("e")), m.group("proj")
        stored = pre + ("down_proj" if proj == "down_proj" else "gate_up_proj")
        if stored not in self._get:
            return None
        return stored, e, (None if proj == "down_proj" else (0 if proj == "gate_proj" else 1))

    def unused(self, used: Iterable[str], ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
        """Stored tensors that no used name reads (minus ignored prefixes), sorted."""
        consumed = {self.stored_name(n) for n in used if n in self}
        ignored = tuple(ignore_prefixes)
        return sorted(n for n in self._get if n not in consumed and not (ignored and n.startswith(ignored)))


def _read(path: str, key: str) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor(key)


def _read_slice(path: str, key: str, e: int, rows: Optional[slice]) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        sl = f.get_slice(key)
        t = sl[e : e + 1] if rows is None else sl[e : e + 1, rows]
    return t[0]
