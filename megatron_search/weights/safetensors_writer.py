"""Write HF tensors to a sharded safetensors checkpoint as they stream in.

Tensors are buffered up to `max_shard_bytes`, then written as one `model-XXXXX.safetensors` file
(to a temporary name, then renamed, so a crash never leaves a half-written shard under the final
name). `close()` renames the shards to `model-i-of-n` form and writes
`model.safetensors.index.json`, the layout transformers and SGLang read.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        fname = f"part-{len(self._files):05d}.safetensors"
        tmp = self.out / (fname + ".tmp")
        save_file(self._pending, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.out / fname)
        self._files.append((fname, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish: final shard names and the index; returns the file names."""
        self._flush()
        n = len(self._files)
        weight_map, names = {}, []
        for i, (fname, tensors) in enumerate(self._files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / fname, self.out / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = self.out / "model.safetensors.index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, self.out / "model.safetensors.index.json")
        return names
