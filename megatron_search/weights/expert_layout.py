"""Per-expert <-> fused HF expert tensors, for writing checkpoints in the layout they came in.

The mapping table speaks per-expert names (`...mlp.experts.{j}.{gate,up,down}_proj.weight`).
Published Qwen3.5 checkpoints store experts fused: `mlp.experts.gate_up_proj` [E, 2I, H] (gate
rows first) and `mlp.experts.down_proj` [E, H, I]. `ExpertFuser` turns a stream of per-expert
tensors into the fused ones, emitting a fused tensor as soon as all E experts of it arrived (the
exporter yields a layer's experts together, so it holds at most one layer's experts).
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

_PER_EXPERT = re.compile(r"^(?P<pre>.*mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_SUFFIX = "mlp.experts.gate_up_proj"


def is_fused_checkpoint(names: Iterable[str]) -> bool:
    """True when the language-model experts are stored fused (mtp.* keeps per-expert names)."""
    return any(n.endswith(FUSED_SUFFIX) and not n.startswith("mtp.") for n in names)


class ExpertFuser:
    """feed(name, tensor) -> the (name, tensor) pairs ready to write; close() checks nothing is left."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        m = _PER_EXPERT.match(name)
        if m is None or name.startswith("mtp."):
            yield name, tensor
            return
        pre, e, proj = m.group("pre"), int(m.group("e")), m.group("proj")
        key = (pre, "down_proj" if proj == "down_proj" else "gate_up_proj")
        slot = self._pending.setdefault(key, {})
        if proj == "down_proj":
            slot[e] = tensor
        else:  # gate and up of one expert arrive separately: keep them as a pair
            pair = slot.get(e, [None, None])
            pair[0 if proj == "gate_proj" else 1] = tensor
            slot[e] = pair
        if len(slot) == self.num_experts and all(not isinstance(v, list) or None not in v for v in slot.values()):
            del self._pending[key]
            rows = [slot[j] if key[1] == "down_proj" else torch.cat(slot[j], 0) for j in range(self.num_experts)]
            yield pre + key[1], torch.stack(rows, 0)

    def close(self) -> None:
        if self._pending:
            (pre, proj), got = next(iter(self._pending.items()))
            raise ValueError(f"{pre}{proj}: only {len(got)} of {self.num_experts} experts were exported")
