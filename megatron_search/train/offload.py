"""Move the trainer's state off its device while colocated engines use the memory, and back.

Colocated GRPO shares each GPU between Megatron and an SGLang engine in turn (RECIPE 1, DESIGN "At
scale"): during rollouts the engine holds its weights and KV cache, so the trainer's parameters,
gradient buffers and optimizer state must not stay resident; during training the engine releases its
memory. `StateOffloader` finds every storage behind the model chunks (parameters, Megatron's main_grad
buffers) and the optimizer (Adam moments, fp32 master copies; chained and distributed optimizers
included), copies each once to host memory (pinned on GPU hosts) and frees it on the device by
resizing the storage to zero bytes; `reload` restores the bytes into the same storages, so every view
(main_grad, DDP buckets, optimizer references) is valid again. The gradient buffers are freed without a
copy and come back zeroed: the next step zeroes them before it accumulates anyway, and at 397B they are
16.8 GiB per GPU each way. After freeing, the caching allocator returns the memory to the driver
(`torch.cuda.empty_cache`), or the engines could not have it. On CPU the copies go to fresh host
buffers and the originals are freed the same way, so the move is real there too. An offloaded tensor
has no memory behind it (reading it is undefined: a crash, not an error), so the GRPO loop offloads only
around the phases that never touch the trainer, and `Trainer` refuses to step while `offloaded`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from megatron_search.plan.residency import Ledger


def _optimizer_tensors(opt) -> Iterator[torch.Tensor]:
    """Every tensor a Megatron optimizer (or a torch one inside it) holds: states and fp32 master copies."""
    seen: set[int] = set()
    stack = [opt]
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        chained = getattr(o, "chained_optimizers", None)
        if chained:  # Megatron's ChainedOptimizer refuses `.optimizer` when it holds more than one
            stack.extend(chained)
            continue
        inner = o.__dict__.get("optimizer") if hasattr(o, "__dict__") else None
        if inner is not None and inner is not o:
            stack.append(inner)
        for state in getattr(o, "state", {}).values() if isinstance(getattr(o, "state", None), dict) else []:
            if isinstance(state, dict):
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for name in ("fp32_from_float16_groups", "fp32_from_fp32_groups", "shard_fp32_from_float16_groups",
                     "shard_fp32_groups"):
            for group in getattr(o, name, None) or []:
                yield from (t for t in group if isinstance(t, torch.Tensor))


KINDS = ("params", "grads", "optimizer")
DISCARDED = ("grads",)  # contents not kept across an offload: reloaded as zeros


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: a discarded kind, zero-filled on reload


@dataclass
class StateOffloader:
    """Offload / reload the trainer's storages by kind (params, grads, optimizer); `resident_bytes()` is what
    it occupies on its device now. A storage shared by two kinds (an fp32 optimizer stepping the parameters
    themselves) belongs to the first kind that names it, in KINDS order."""

    model_chunks: list
    optimizer: object
    saved: dict[str, list[_Saved]] = field(default_factory=dict)
    ledger: Optional[Ledger] = None  # told what arrives and leaves, as holders[kind] (plan/residency.py)
    holders: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.ledger is not None:
            storages = self._storages()
            self.ledger.arrive(*(h for k, h in self.holders.items() if any(s.nbytes() for s in storages[k])))

    def _report(self, kinds, arrived: bool) -> None:
        if self.ledger is not None:
            names = [self.holders[k] for k in kinds if k in self.holders]
            (self.ledger.arrive if arrived else self.ledger.leave)(*names)

    def _storages(self) -> dict[str, list[torch.UntypedStorage]]:
        named: dict[str, list[torch.Tensor]] = {k: [] for k in KINDS}
        for chunk in self.model_chunks:
            for p in chunk.parameters():
                named["params"].append(p.data)
                g = getattr(p, "main_grad", None)
                if isinstance(g, torch.Tensor):
                    named["grads"].append(g)
                if p.grad is not None:
                    named["grads"].append(p.grad)
        named["optimizer"] = list(_optimizer_tensors(self.optimizer))
        out: dict[str, list[torch.UntypedStorage]] = {k: [] for k in KINDS}
        seen = set()
        for kind in KINDS:
            for t in named[kind]:
                s = t.untyped_storage()
                key = (s.device, s.data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                if s.nbytes() or kind in self.saved:
                    out[kind].append(s)
        return out

    @property
    def offloaded(self) -> bool:
        """Anything is off the device (training must not run then)."""
        return bool(self.saved)

    def offloaded_kinds(self) -> set[str]:
        return set(self.saved)

    def resident_bytes(self) -> int:
        return sum(s.nbytes() for group in self._storages().values() for s in group)

    def offload(self, kinds=KINDS) -> int:
        """Copy the storages of `kinds` (those not offloaded yet) to host and free them on the device (the gradient
        buffers without a copy); returns the bytes moved."""
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"StateOffloader.offload: unknown kinds {sorted(unknown)}; choose from {KINDS}")
        moved = 0
        pin = torch.cuda.is_available()
        storages = self._storages()
        fresh: list[_Saved] = []
        for kind in KINDS:
            if kind not in kinds or kind in self.saved:
                continue
            items = []
            for s in storages[kind]:
                n = s.nbytes()
                if n == 0:
                    continue
                host = None
                if kind not in DISCARDED:
                    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                    host.copy_(_bytes_view(s, n), non_blocking=pin)
                    moved += n
                items.append(_Saved(s, n, host))
            self.saved[kind] = items
            fresh += items
        if pin:
            torch.cuda.synchronize()
        for item in fresh:
            item.storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed blocks back to the driver, where the engines can map them
        self._report(kinds, arrived=False)
        return moved

    def reload(self, kinds=KINDS) -> int:
        """Give the storages of `kinds` their bytes back (same storage objects, so views stay valid)."""
        moved = 0
        back = [k for k in KINDS if k in kinds and k in self.saved]
        for kind in back:
            for item in self.saved.pop(kind):
                item.storage.resize_(item.nbytes)
                if item.host is None:
                    _bytes_view(item.storage, item.nbytes).zero_()
                    continue
                _bytes_view(item.storage, item.nbytes).copy_(item.host, non_blocking=item.host.is_pinned())
                moved += item.nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._report(back, arrived=True)
        return moved


def _bytes_view(storage: torch.UntypedStorage, n: int) -> torch.Tensor:
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    t.set_(storage, 0, (n,))
    return t
