"""HF <-> Megatron on 2 gloo processes (TP=2+SP, EP=2, PP=2), both architectures, one spawn.

References come from the HF model itself (transformers, fp32): its logits, its greedy generation,
and the safetensors it saved. Checked: Megatron logits at every layout (max abs diff <= 1e-4 of their size);
the exporter gives back every stored tensor bit for bit; a distributed checkpoint saved at TP=2
and exported at PP=2 equals the original files (vision weights carried through); each delivery
path makes the local engine generate exactly what HF generates; routing replay forces the
engine's experts (100 %) and arbitrary ones; bad checkpoints fail naming the tensor.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_search.weights.hf_source import HFTensorSource
from megatron_search.weights.launch import run_ranks

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("qwen3_moe", "qwen3_5_moe")
PROMPT = [5, 17, 300, 42, 7, 1999, 64, 128, 3, 11, 256, 900]
NEW_TOKENS = 6  # prompt + output = 18 tokens: even, so sequence parallel splits it over TP=2


def _hf_class(name: str):
    import transformers

    return transformers.AutoModelForImageTextToText if name == "qwen3_5_moe" else transformers.AutoModelForCausalLM


def _make_checkpoint(name: str, out: Path) -> None:
    """Random tiny HF model with every tensor perturbed (norms included), saved as safetensors."""
    from transformers import AutoConfig

    src = REPO / "configs" / "models" / f"tiny_{name}"
    torch.manual_seed(1 if name == "qwen3_moe" else 2)
    model = _hf_class(name).from_config(AutoConfig.from_pretrained(str(src)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(out))
    shutil.copy(src / "config.json", out / "config.json")  # the repo's config (schema field names)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    ids = torch.randint(0, 2048, (2, 16))
    torch.save(ids, work / "ids.pt")
    refs = {}
    for name in ARCHS:
        _make_checkpoint(name, work / name)
        hf = _hf_class(name).from_pretrained(str(work / name), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
            gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        refs[name] = {"logits": logits, "generated": gen[0, len(PROMPT):].tolist()}
    per_rank = run_ranks(_main, 2, str(work), list(ARCHS), PROMPT, NEW_TOKENS, timeout_s=600)
    return work, refs, per_rank


def _main(*args):
    from _weights_worker import main

    return main(*args)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_logits_match_hf(run, name, layout):
    _, refs, per_rank = run
    got = [r[name]["logits"][layout] for r in per_rank if layout in r[name]["logits"]]
    assert got  # the last stage's TP rank 0 (every DP replica) reports logits
    ref = refs[name]["logits"]
    for logits in got:
        # fp32 at another layout sums in another order (TP partial sums, EP token dispatch): relative bound
        assert (logits - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_export_bitwise(run, name, layout):
    work, _, per_rank = run
    names, bad = per_rank[0][name]["export"][layout]
    stored = HFTensorSource.from_dir(work / name).names()
    language = {n for n in stored if not n.startswith(("model.visual.", "mtp."))}
    assert bad == []
    assert sorted(names) == sorted(language) and len(names) == len(set(names))
    assert per_rank[1][name]["export"][layout] == ([], [])  # buckets are empty off rank 0


@pytest.mark.parametrize("name", ARCHS)
def test_dist_checkpoint_round_trip(run, name):
    work, _, _ = run
    a, b = HFTensorSource.from_dir(work / name), HFTensorSource.from_dir(work / f"{name}_back")
    assert a.names() == b.names()
    for n in a.names():
        x, y = a.get(n), b.get(n)
        assert x.dtype == y.dtype and torch.equal(x, y), n
    assert (work / f"{name}_back" / "config.json").read_text() == (work / name / "config.json").read_text()
    if name == "qwen3_5_moe":
        assert any(n.startswith("model.visual.") for n in b.names())


@pytest.mark.parametrize("name", ARCHS)
def test_delivery_paths_generate_like_hf(run, name):
    _, refs, per_rank = run
    d = per_rank[0][name]["delivery"]
    # The engine lives in rank 0's process, so no broadcast group can join it (torch registers a group
    # name once per process; an SGLang server is always another process): the distributed path is
    # checked across processes in test_weights_sync_owner_parallel.py.
    for mode in ("tensor", "disk"):
        assert d[mode]["ids"] == refs[name]["generated"], mode
        assert d[mode]["version"] == f"{mode}-1"
        assert d[mode]["buckets"] > 1  # 600 KiB buckets: the update really is split


@pytest.mark.parametrize("name", ARCHS)
def test_routing_replay(run, name):
    _, _, per_rank = run
    d = per_rank[0][name]["delivery"]
    assert d["agree_on"] == 1.0
    assert d["agree_forced"] == 1.0  # replay overrides what the router would pick
    assert 0.0 <= d["agree_off"] <= 1.0


@pytest.mark.parametrize("name", ARCHS)
def test_bad_checkpoints_name_the_tensor(run, name):
    _, _, per_rank = run
    for rank in (0, 1):  # every rank raises: none is left waiting in a collective
        bad = per_rank[rank][name]["bad"]
        victim = bad["victim"]
        assert "MissingTensorError" in bad["missing"] or "CheckpointMismatchError" in bad["missing"]
        assert victim in bad["missing"] and "missing" in bad["missing"]
        assert "model.layers.99.mlp.gate.weight" in bad["extra"] and "does not use" in bad["extra"]
        assert victim in bad["shape"] and "shape" in bad["shape"]
        assert "BucketTooSmallError" in bad["bucket"] and "embed_tokens" in bad["bucket"]
