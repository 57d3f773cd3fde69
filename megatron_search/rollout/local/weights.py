"""Load HF-named tensors into the local engine's transformers model, as SGLang does.

Accepted names: the model's own parameter names (fused experts `mlp.experts.gate_up_proj`
[E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]) and the per-expert HF
checkpoint names `mlp.experts.{j}.{gate,up,down}_proj.weight` (Qwen3-MoE checkpoints), which
land in the matching slice of the fused tensor. `mtp.*` tensors are skipped: transformers
builds no MTP layers, and this engine does no speculative decoding. Every name and shape is
checked before the first byte is written: a bad update (the third tensor misshapen, say) leaves the
previous weights serving. The writes are one `copy_` per tensor (which also casts to the
parameter's dtype): no converted or cloned temporaries.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open

from megatron_search.rollout.engine.tensor_payload import WeightUpdateError

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<j>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
SKIPPED_PREFIXES = ("mtp.",)




def _target(params: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, tuple]:
    """The parameter (and index into it) that HF tensor `name` writes."""
    if name in params:
        return params[name], ()
    m = _PER_EXPERT.match(name)
    if m:
        proj = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
        fused = params.get(f"{m['prefix']}.{proj}")
        if fused is not None:
            j = int(m["j"])
            if j >= fused.shape[0]:
                raise WeightUpdateError(f"{name}: expert {j} out of range (model has {fused.shape[0]} experts)")
            if m["proj"] == "down_proj":
                return fused, (j,)
            half = fused.shape[1] // 2
            rows = slice(0, half) if m["proj"] == "gate_proj" else slice(half, 2 * half)
            return fused, (j, rows)
    near = [p for p in params if p.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]][:3]
    hint = f"; parameters under the same module: {near}" if near else ""
    raise WeightUpdateError(f"{name}: no such parameter in the served model{hint}")


Plan = list[tuple[torch.Tensor, torch.Tensor]]  # (destination view of a parameter, received tensor)


def plan_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[Plan, int]:
    """Check a whole update against `model` without writing: (the copies to make, tensors skipped).

    Every check is per tensor (name, shape, floating dtype), none reads the bytes; a bad tensor anywhere
    raises before the first write. A dtype that differs from the parameter's is converted by the copy itself
    (`copy_` casts), so no converted temporary is made."""
    params = dict(model.named_parameters())
    plan: Plan = []
    skipped = 0
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name!r}: expected (name, tensor), got ({type(name).__name__}, "
                                    f"{type(tensor).__name__})")
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        dest, index = _target(params, name)
        view = dest[index] if index else dest
        if tuple(view.shape) != tuple(tensor.shape):
            raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(view.shape)}")
        if not (tensor.is_floating_point() and dest.is_floating_point()):
            raise WeightUpdateError(f"{name}: dtype {tensor.dtype} is not a floating point weight")
        plan.append((view, tensor))
    return plan, skipped


def write_plan(plan: Plan) -> None:
    """The writes of a checked update: one copy per tensor into the parameter's storage (cast and moved to
    its dtype and device on the way). Nothing here can fail on a plan from `plan_named_tensors`."""
    with torch.no_grad():
        for view, tensor in plan:
            view.copy_(tensor)


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """Copy tensors into `model` by HF name. Returns (loaded, skipped). Atomic on error: everything is checked
    (`plan_named_tensors`) before the first byte is written (`write_plan`)."""
    plan, skipped = plan_named_tensors(model, named)
    write_plan(plan)
    return len(plan), skipped


def weights_sha256(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every parameter's bytes by name: lets a test check that an engine holds exactly the trainer's weights."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous().cpu()
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    return out


def read_safetensors_dir(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """All tensors of the *.safetensors files in an HF checkpoint directory (sorted by file)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise WeightUpdateError(f"update_weights_from_disk: no .safetensors files in {path}")
    out = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    out.append((key, sf.get_tensor(key)))
        except Exception as e:  # safetensors raises its own error type on a corrupt header or body
            raise WeightUpdateError(f"update_weights_from_disk: {f} is not a readable safetensors file ({e})") from None
    return out


def check_dtypes(dtypes: Sequence[str]) -> list[torch.dtype]:
    """torch dtypes for SGLang's dtype strings ('bfloat16' or 'torch.bfloat16')."""
    out = []
    for d in dtypes:
        if not isinstance(d, str):
            raise WeightUpdateError(f"dtypes: {d!r} is not a dtype name")
        name = d.split(".")[-1]
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise WeightUpdateError(f"unknown dtype {d!r}")
        out.append(dt)
    return out
