"""HF safetensors <-> Megatron distributed checkpoint, on every rank of a TP x PP x EP world.

hf_to_mcore: each rank builds its model shard, fills it tensor by tensor from the HF files
(`load.py`) and all ranks save one `megatron.core.dist_checkpointing` checkpoint; the checkpoint
is layout-free, so it loads at any other TP/PP/EP. mcore_to_hf: each rank builds its shard at any
layout, loads the distributed checkpoint (Megatron reshards), and the bucketed exporter streams
HF tensors to rank 0, which writes sharded safetensors. Beside the Megatron files, `hf_extra/`
keeps what Megatron does not hold (config.json, tokenizer and generation files, vision tensors, and
the MTP tensors when model.mtp is off), so a round trip gives back the full HF checkpoint. With
model.mtp on, the MTP weights live in the Megatron checkpoint and are exported from it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from tqdm import tqdm

from megatron_search.config.hf import architecture_from_hf, load_hf_config
from megatron_search.config.model import weights_format
from megatron_search.distributed import collectives as coll
from megatron_search.models.hf_mapping import Mapping
from megatron_search.models.provider import build_model_chunks
from megatron_search.weights.expert_layout import ExpertFuser, is_fused_checkpoint
from megatron_search.weights.export import HFExporter
from megatron_search.weights.hf_source import HFTensorSource
from megatron_search.weights.load import CheckpointMismatchError, load_hf_into_model
from megatron_search.weights.safetensors_writer import ShardedSafetensorsWriter
from megatron_search.weights.sources import EXTRA_DIR

LAYOUT_FILE = "layout.json"  # how the source stored its experts: {"fused_experts": bool}
# Small files of an HF checkpoint that travel with it unchanged: what transformers, SGLang and vLLM read beside the
# weights (Qwen3.5's multimodal class builds its processor from the preprocessor / processor files even when only
# text is served).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json", "video_preprocessor_config.json",
              "processor_config.json")


def _state_dict_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"  # Megatron's own naming (model0, model1 with VPP)


def _barrier() -> None:
    if dist.is_initialized():
        coll.barrier()


def check_architecture(model, hf_config_path: Path) -> None:
    """The architecture of a ModelConfig must equal the one stored with the checkpoint."""
    stored = architecture_from_hf(load_hf_config(hf_config_path), where=str(hf_config_path))
    want = model.architecture
    if stored != want:
        diffs = [f"{k}: checkpoint {getattr(stored, k)} vs config {getattr(want, k)}"
                 for k in stored.__dataclass_fields__ if getattr(stored, k) != getattr(want, k)]
        raise CheckpointMismatchError(
            f"{hf_config_path}: the checkpoint's architecture does not match model.hf_config "
            f"({model.hf_config}): " + "; ".join(diffs)
        )


def hf_to_mcore(cfg, hf_dir: str | Path, out_dir: str | Path, groups, *, progress: bool = True) -> None:
    """Convert an HF safetensors directory to a Megatron distributed checkpoint (collective)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_architecture(cfg.model, hf_dir / "config.json")
    arch = cfg.model.architecture
    source = HFTensorSource.from_dir(hf_dir)
    chunks = build_model_chunks(cfg, groups)
    load_hf_into_model(chunks, arch, source, groups, progress=progress)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    sharded = {_state_dict_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
    dist_checkpointing.save(sharded, str(out_dir))
    if rank0:
        _write_extra(hf_dir, out_dir / EXTRA_DIR, source, Mapping(arch, mtp=cfg.model.mtp))
    _barrier()


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the HF side files (SIDE_FILES) that `src` holds and `dst` lacks; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def _write_extra(hf_dir: Path, extra: Path, source: HFTensorSource, mapping: Mapping) -> None:
    extra.mkdir(parents=True, exist_ok=True)
    copy_side_files(hf_dir, extra)
    (extra / LAYOUT_FILE).write_text(json.dumps({"fused_experts": is_fused_checkpoint(source.names())}))
    carried = sorted(n for n in source.names() if mapping.is_passthrough(n))
    if carried:
        writer = ShardedSafetensorsWriter(extra / "passthrough")
        for n in carried:
            writer.add(n, source.get(n))
        writer.close()


def load_mcore_checkpoint(cfg, ckpt_dir: str | Path, groups) -> list[torch.nn.Module]:
    """Build this rank's model chunks (in `groups`) and load a distributed checkpoint into them (any layout)."""
    chunks = build_model_chunks(cfg, groups)
    load_mcore_into(cfg, chunks, ckpt_dir)
    return chunks


def load_mcore_into(cfg, chunks: list, ckpt_dir: str | Path) -> None:
    """Every rank: load a `hf_to_mcore` checkpoint (any layout) into this rank's built chunks, in place (so a
    model already wrapped in DDP keeps its buffers)."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir}: not a Megatron distributed checkpoint (no metadata.json)")
    if (ckpt_dir / EXTRA_DIR / "config.json").is_file():
        check_architecture(cfg.model, ckpt_dir / EXTRA_DIR / "config.json")
    sharded = {_state_dict_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    for i, c in enumerate(chunks):
        result = c.load_state_dict(loaded[_state_dict_key(i, len(chunks))], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:  # TE's _extra_state may be absent from a checkpoint written without TE; weights may not
            raise CheckpointMismatchError(f"{ckpt_dir}: no value for {len(missing)} parameter(s) of this model, "
                                          f"e.g. {missing[:3]}")


def mcore_to_hf(cfg, ckpt_dir: str | Path, out_dir: str | Path, groups, *, bucket_bytes: int = 512 << 20,
                max_shard_bytes: int = 4 << 30, out_dtype: Optional[torch.dtype] = None,
                progress: bool = True, fused_experts: Optional[bool] = None) -> Optional[dict[str, Any]]:
    """Convert a Megatron distributed checkpoint to HF safetensors (collective; rank 0 writes).

    `fused_experts`: write `mlp.experts.gate_up_proj` / `down_proj` instead of per-expert names;
    None = as the converted HF checkpoint stored them (hf_extra/layout.json), else per-expert.
    Returns a summary on rank 0 (tensor count, bytes, files), None elsewhere.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    chunks = load_mcore_checkpoint(cfg, ckpt_dir, groups)
    exporter = HFExporter(chunks, cfg.model.architecture, groups, bucket_bytes, out_dtype=out_dtype)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes) if rank0 else None
    if fused_experts is None:
        layout = ckpt_dir / EXTRA_DIR / LAYOUT_FILE
        fused_experts = layout.is_file() and bool(read_json(layout).get("fused_experts"))
    fuser = ExpertFuser(cfg.model.architecture.num_experts) if fused_experts else None
    count = 0
    bar = tqdm(total=exporter.total_bytes, unit="B", unit_scale=True, desc="export Megatron -> HF",
               disable=not (progress and rank0))
    for bucket in exporter:
        for name, t in bucket:
            bar.update(t.numel() * t.element_size())
            for out_name, out_t in (fuser.feed(name, t) if fuser else [(name, t)]):
                writer.add(out_name, out_t)
                count += 1
    bar.close()
    if fuser is not None:
        fuser.close()
    if not rank0:
        _barrier()
        return None
    extra = ckpt_dir / EXTRA_DIR
    count += write_passthrough(writer, cfg, extra / "passthrough")
    files = writer.close()
    copy_side_files(extra, out_dir)
    # a training checkpoint carries no hf_extra: the model's own HF files (model.path's, else model.hf_config's)
    # make the output a directory transformers, SGLang and vLLM load
    copy_side_files(cfg.model.engine_dir(), out_dir)
    hf_config = cfg.model.resolved_hf_config()
    if hf_config.is_file() and not (out_dir / "config.json").exists():
        shutil.copy2(hf_config, out_dir / "config.json")
    _barrier()
    return {"tensors": count, "bytes": writer.total_bytes, "files": files}


def write_passthrough(writer: ShardedSafetensorsWriter, cfg, carried: Optional[Path] = None) -> int:
    """Rank 0: add the HF tensors Megatron does not hold (Qwen3.5's vision tower; mtp.* unless model.mtp) to an
    export, so it is the whole model (transformers would draw them at random, vLLM refuses a checkpoint without
    them). From a convert output's hf_extra/passthrough (`carried`), else from model.path's own weights (a
    training run's checkpoint keeps none). Returns how many were written."""
    if carried is None or not carried.is_dir():
        path = cfg.model.resolved_path()
        kind = weights_format(path) if path is not None else None
        carried = path if kind == "hf" else path / EXTRA_DIR / "passthrough" if kind == "mcore" else None
        if carried is None or not carried.is_dir() or not any(carried.glob("*.safetensors")):
            return 0
    source = HFTensorSource.from_dir(carried)
    keep = Mapping(cfg.model.architecture, mtp=cfg.model.mtp)
    names = sorted(n for n in source.names() if keep.is_passthrough(n))  # mtp.* is the model's own with model.mtp
    for name in names:
        writer.add(name, source.get(name))
    return len(names)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
