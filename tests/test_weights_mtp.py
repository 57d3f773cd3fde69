"""Qwen3.5's multi-token-prediction (MTP) layer: HF mtp.* <-> Megatron mtp.layers.0.*, forward, GRPO freeze.

The tiny Qwen3.5 gets one MTP layer (mtp_num_hidden_layers=1); its HF tensors are named after
transformers' own decoder-layer class (per-expert, as published checkpoints store MTP experts) plus
`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm` (the names SGLang's / vLLM's MTP loaders
read). On 2 gloo processes, with model.mtp=true:
  DP=2, TP=2 (+SP), EP=2, PP=2: load, export, every tensor bit for bit (MTP included, once); at PP=2
        the MTP stage's own copy of the word embedding equals the first stage's;
  DP=2: the eh_proj input is [norm_e(embedding of token t+1), norm_h(hidden_t)] and the MTP logits
        equal a float64 reference built from transformers' layers, written here; an SFT trainer step
        reports the masked cross entropy of token t+2 under the batch's loss mask as its MTP loss and
        moves the MTP weights; a forward without labels gives the main head's logits (GRPO); a
        GRPO-style update with the trainer's frozen MTP leaves every MTP weight bitwise as loaded;
        model.mtp=false carries mtp.* through; a checkpoint without an MTP tensor fails naming it.
Pure-mapping checks (names, passthrough, refusals) run without Megatron.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import Mapping, MappingError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "models" / "tiny_qwen3_5_moe"
SEQ, BATCH = 16, 2
LAYOUTS = {"dp2": (1, 1, 1), "tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}
MTP_TOP = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


# ---------------------------------------------------------------------------- mapping only
def _arch(mtp_layers: int = 1) -> Architecture:
    from megatron_search.config.hf import architecture_from_hf

    raw = json.loads((TINY / "config.json").read_text())
    return dataclasses.replace(architecture_from_hf(raw), mtp_num_layers=mtp_layers)


def test_mtp_names_follow_the_published_layout():
    m = Mapping(_arch(), mtp=True)
    want = {
        "mtp.layers.0.enorm.weight": ("mtp.pre_fc_norm_embedding.weight",),
        "mtp.layers.0.hnorm.weight": ("mtp.pre_fc_norm_hidden.weight",),
        "mtp.layers.0.eh_proj.weight": ("mtp.fc.weight",),
        "mtp.layers.0.final_layernorm.weight": ("mtp.norm.weight",),
        "mtp.layers.0.transformer_layer.input_layernorm.weight": ("mtp.layers.0.input_layernorm.weight",),
        "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight":
            tuple(f"mtp.layers.0.self_attn.{x}_proj.weight" for x in "qkv"),
        "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight": ("mtp.layers.0.self_attn.o_proj.weight",),
        "mtp.layers.0.transformer_layer.mlp.router.weight": ("mtp.layers.0.mlp.gate.weight",),
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight":
            ("mtp.layers.0.mlp.experts.3.gate_proj.weight", "mtp.layers.0.mlp.experts.3.up_proj.weight"),
        "mtp.layers.0.transformer_layer.mlp.shared_experts.gate_weight": ("mtp.layers.0.mlp.shared_expert_gate.weight",),
    }
    for mcore, hf in want.items():
        match = m.match(mcore)
        assert match.hf_names == hf, mcore
        assert match.layer == 4  # after the 4 decoder layers: exported after them
    assert m.match("mtp.layers.0.eh_proj.weight").rule.tp.dim == 0  # column-parallel, as Megatron builds it
    # the MTP layer is gated full attention: no GDN rule applies to it
    with pytest.raises(MappingError):
        m.match("mtp.layers.0.transformer_layer.self_attention.in_proj.weight")


def test_mtp_norms_are_zero_centred_on_both_sides():
    m = Mapping(_arch(), mtp=True)
    w = torch.randn(64)
    for name in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight"):
        match = m.match(name)
        # HF x * (1 + w) and Megatron's zero-centred norm hold the same number; a plain-gain module is w + 1
        assert torch.equal(m.to_mcore(match, [w], mcore_zero_centered=True), w)
        assert torch.equal(m.to_mcore(match, [w], mcore_zero_centered=False), w + 1)


def test_mtp_off_is_passthrough_and_on_is_mapped():
    off, on = Mapping(_arch()), Mapping(_arch(), mtp=True)
    assert off.is_passthrough("mtp.fc.weight") and off.is_passthrough("model.visual.blocks.0.attn.qkv.weight")
    assert not on.is_passthrough("mtp.fc.weight") and on.is_passthrough("model.visual.blocks.0.attn.qkv.weight")
    with pytest.raises(MappingError, match="mtp=True"):
        off.match("mtp.layers.0.eh_proj.weight")


def test_mtp_mapping_refuses_what_it_cannot_map():
    with pytest.raises(MappingError, match="no MTP layers"):
        Mapping(_arch(0), mtp=True)
    with pytest.raises(MappingError, match="mtp_num_hidden_layers=2"):
        Mapping(_arch(2), mtp=True)


# ---------------------------------------------------------------------------- checkpoint + reference
def _make_checkpoint(out: Path):
    """Random tiny Qwen3.5 + one MTP layer saved as safetensors; returns (HF model, MTP tensors, text config,
    index of a full-attention layer)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeDecoderLayer,
        Qwen3_5MoeForConditionalGeneration,
    )

    raw = json.loads((TINY / "config.json").read_text())
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    out.mkdir(parents=True)
    torch.manual_seed(7)
    hf_cfg = AutoConfig.from_pretrained(str(TINY))
    model = Qwen3_5MoeForConditionalGeneration(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(8)

    def rand(t, name):
        if "linear_attn.norm" in name:  # the GDN output norm is a plain gain around 1 in HF; Megatron holds
            # w - 1, exact (and so bitwise back) for w in [0.5, 2]: the range trained gains live in
            return 0.6 + torch.rand(t.shape, generator=gen)
        return torch.randn(t.shape, generator=gen) * (0.3 if "norm" in name else 0.1)  # zero-centred: no shift

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(rand(t, name))
    model.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(raw))
    assert not (out / "model.safetensors.index.json").exists()  # one file: the MTP file beside it is read too

    text = hf_cfg.text_config
    full_attention = text.layer_types.index("full_attention")
    layer = Qwen3_5MoeDecoderLayer(text, full_attention)  # transformers' own names for a gated-attention MoE layer
    mtp: dict[str, torch.Tensor] = {}
    inter = text.moe_intermediate_size
    for name, t in layer.state_dict().items():
        t = rand(t, name).float()
        if name == "mlp.experts.gate_up_proj":  # published MTP experts are per-expert
            for j in range(t.shape[0]):
                mtp[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = t[j, :inter].clone()
                mtp[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = t[j, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for j in range(t.shape[0]):
                mtp[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = t[j].clone()
        else:
            mtp[f"mtp.layers.0.{name}"] = t
    h = text.hidden_size
    mtp["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.1).float()
    for n in MTP_TOP[1:]:
        mtp[n] = (torch.randn(h, generator=gen) * 0.3).float()
    save_file(mtp, str(out / "mtp.safetensors"))
    return model, mtp, text, full_attention


def _rms1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3.5 RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@torch.no_grad()
def _reference(model, mtp, text, full_attention, ids):
    """float64: h_t = final-normed hidden of the main model; MTP input at t = fc(cat[norm_e(emb(x_{t+1})),
    norm_h(h_t)]) -> one HF decoder layer (causal) -> norm -> lm_head. Returns eh_proj input and logits."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    m = model.double()
    m.config._experts_implementation = "eager"  # the plain loop over experts (grouped_mm has no float64)
    text._experts_implementation = "eager"
    lm = m.model.language_model
    eps = text.rms_norm_eps
    b, s = ids.shape
    hidden = lm(input_ids=ids).last_hidden_state  # after the final norm, as Megatron's decoder hands it on
    main_logits = m.lm_head(hidden)
    nxt = torch.roll(ids, -1, dims=1)  # token t+1 at position t (the last position has none)
    emb = lm.embed_tokens(nxt)
    cat = torch.cat([_rms1p(emb, mtp["mtp.pre_fc_norm_embedding.weight"].double(), eps),
                     _rms1p(hidden, mtp["mtp.pre_fc_norm_hidden.weight"].double(), eps)], -1)
    x = cat @ mtp["mtp.fc.weight"].double().T
    text._attn_implementation = "sdpa"
    layer = Qwen3_5MoeDecoderLayer(text, full_attention).double().eval()
    sd = {}
    for name in layer.state_dict():
        if name == "mlp.experts.gate_up_proj":
            sd[name] = torch.stack([torch.cat([mtp[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"],
                                               mtp[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"]])
                                    for j in range(text.num_experts)])
        elif name == "mlp.experts.down_proj":
            sd[name] = torch.stack([mtp[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] for j in range(text.num_experts)])
        else:
            sd[name] = mtp[f"mtp.layers.0.{name}"]
    layer.load_state_dict({k: v.double() for k, v in sd.items()})
    pos = torch.arange(s).view(1, 1, s).expand(3, b, s)  # text-only mRoPE: the three sections share positions
    rope = lm.rotary_emb(x, pos)
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    y = layer(x, position_embeddings=rope, attention_mask=causal)
    logits = m.lm_head(_rms1p(y, mtp["mtp.norm.weight"].double(), eps))
    return {"eh_in": cat, "mtp_logits": logits, "main_logits": main_logits}


# ---------------------------------------------------------------------------- ranks
def _cfg(ckpt: str, tp: int, pp: int, ep: int, mtp: bool = True):
    from megatron_search.config.loader import load_config

    ov = [f"model.hf_config={ckpt}", "model.init=random", f"model.mtp={str(mtp).lower()}", f"parallel.tp={tp}", f"parallel.pp={pp}",
          f"parallel.ep={ep}", f"parallel.etp={tp if ep == 1 else 1}", "parallel.world_size=2", "optim.lr=1e-2"]
    if tp > 1:
        ov.append("parallel.sequence_parallel=true")
    return load_config(None, ov)


@torch.no_grad()
def _mtp_forward(model, ids):
    """eh_proj input, MTP logits (with labels: the MTP block runs) and main logits (no labels)."""
    model.eval()
    s = ids.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand_as(ids)
    seen = {}
    h1 = model.mtp.layers[0].eh_proj.register_forward_pre_hook(lambda mod, args: seen.setdefault("eh_in", args[0]))
    h2 = model.mtp.register_forward_hook(lambda mod, args, out: seen.setdefault("mtp_out", out))
    model(ids, pos, None, labels=torch.roll(ids, -1, 1))
    h1.remove(), h2.remove()
    mtp_hidden = seen["mtp_out"][s:]  # the block returns [main; mtp] hidden states stacked on the sequence dim
    mtp_logits = model.output_layer(mtp_hidden)[0]
    main = model(ids, pos, None)  # no labels: the MTP block is skipped
    # numpy: pickled by value (a tensor would travel as a shared-memory handle of an exiting process)
    return {"eh_in": seen["eh_in"].transpose(0, 1).numpy(), "mtp_logits": mtp_logits.transpose(0, 1).numpy(),
            "main_logits": main.numpy()}


def _sft_step(cfg, ctx, source, ids, mask) -> dict:
    """One SFT trainer step (labels + loss mask, trainer/step.py) on this DP rank's row: the MTP loss
    it reports and which MTP weights the update moved."""
    from megatron_search.trainer.step import Batch
    from megatron_search.trainer.core import Trainer
    from megatron_search.weights.load import load_hf_into_model

    trainer = Trainer(cfg, ctx, total_steps=1)
    load_hf_into_model(trainer.model, cfg.model.architecture, source, ctx.groups)
    before = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters() if n.startswith("mtp.")}
    m = trainer.step(trainer.dp_slice(Batch(ids, torch.roll(ids, -1, 1), mask)), micro_batch_size=1)
    after = dict(trainer.model[0].named_parameters())
    return {"mtp_loss": m["mtp_loss"], "dp_rank": ctx.dp_rank,
            "mtp_changed": sorted(n for n, t in before.items() if not torch.equal(t, after[n].detach()))}


def _frozen_grpo_update(cfg, ctx, source, ids):
    """Trainer(train_mtp=False), one logits-only (GRPO-style) update: MTP untouched, the rest moves."""
    from megatron_search.trainer.core import Trainer
    from megatron_search.weights.load import load_hf_into_model

    trainer = Trainer(cfg, ctx, total_steps=1, train_mtp=False)
    load_hf_into_model(trainer.model, cfg.model.architecture, source, ctx.groups)
    model = trainer.model[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    trainer.apply_lr()
    for m in trainer.ddp:
        m.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.train()
    logits = trainer.ddp[0](ids, pos, None)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1))
    (-logp.mean()).backward()
    model.config.finalize_model_grads_func(trainer.ddp)
    ok, _, _ = trainer.optimizer.step()
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n]))
    return {"ok": bool(ok), "frozen": frozen, "changed": changed,
            "mtp_params": sorted(n for n in before if n.startswith("mtp."))}


def _rank_main(ckpt: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_search.distributed.init import init_distributed
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.weights.hf_source import HFTensorSource
    from megatron_search.weights.load import load_hf_into_model

    from _weights_worker import _error_text, _export_mismatches

    torch.set_num_threads(1)
    source = HFTensorSource.from_dir(ckpt)
    ids = torch.load(Path(ckpt) / "ids.pt")
    out: dict = {"export": {}}
    for lay, (tp, pp, ep) in LAYOUTS.items():
        cfg = _cfg(ckpt, tp, pp, ep)
        arch = cfg.model.architecture
        ctx = init_distributed(cfg)
        chunks = build_model_chunks(cfg, ctx.groups)
        load_hf_into_model(chunks, arch, source, ctx.groups)
        out["export"][lay] = _export_mismatches(chunks, arch, ctx.groups, source, 1 << 20)
        if lay == "pp2":  # GRPO's push leaves the frozen MTP block out (train/grpo_sync.py), on every stage alike
            from megatron_search.weights.export import HFExporter

            pushed = HFExporter(chunks, arch, ctx.groups, 1 << 20, skip_prefixes=("mtp.",))
            out["export"]["pp2_no_mtp"] = [name for bucket in pushed for name, _ in bucket]
        if lay == "pp2":  # the MTP stage holds its own copy of the word embedding (NeMo-RL #2471's setting)
            emb = dict(chunks[0].named_parameters()).get("embedding.word_embeddings.weight")
            out["pp2_embedding"] = (ctx.pp_rank, None if emb is None else emb.detach().numpy().copy())
        if lay == "dp2":
            out["forward"] = _mtp_forward(chunks[0], ids)
            out["sft"] = _sft_step(cfg, ctx, source, ids, torch.load(Path(ckpt) / "mask.pt"))
            sd = {n: source.get(n) for n in source.names() if n != "mtp.fc.weight"}
            out["missing"] = _error_text(lambda: load_hf_into_model(
                chunks, arch, HFTensorSource.from_state_dict(sd, "no-fc"), ctx.groups))
            out["grpo"] = _frozen_grpo_update(cfg, ctx, source, ids)
            off = _cfg(ckpt, 1, 1, 1, mtp=False)
            plain = build_model_chunks(off, ctx.groups)
            load_hf_into_model(plain, off.model.architecture, source, ctx.groups)  # mtp.* carried, not an error
            out["export"]["mtp_off"] = _export_mismatches(plain, off.model.architecture, ctx.groups, source, 1 << 20)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_search.weights.launch import run_ranks

    ckpt = tmp_path_factory.mktemp("mtp") / "ckpt"
    model, mtp, text, full_attention = _make_checkpoint(ckpt)
    ids = torch.randint(0, text.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    torch.save(ids, ckpt / "ids.pt")
    mask = torch.ones(BATCH, SEQ)
    mask[:, : SEQ // 2] = 0  # a "prompt" the loss skips
    mask[1, -3:] = 0  # and some "padding"
    torch.save(mask, ckpt / "mask.pt")
    ref = _reference(model, mtp, text, full_attention, ids)
    ref["mask"] = mask
    per_rank = run_ranks(_rank_main, 2, str(ckpt), timeout_s=600)
    return ckpt, ref, per_rank


def _stored(ckpt: Path) -> set[str]:
    from megatron_search.weights.hf_source import HFTensorSource

    return HFTensorSource.from_dir(ckpt).names()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_round_trip_is_bitwise(run, layout):
    ckpt, _, per_rank = run
    names, bad = per_rank[0]["export"][layout]
    language = {n for n in _stored(ckpt) if not n.startswith("model.visual.")}
    assert any(n.startswith("mtp.layers.0.mlp.experts.") for n in language) and set(MTP_TOP) <= language
    assert bad == []
    assert sorted(names) == sorted(language) and len(names) == len(set(names))  # MTP exported once, PP>1 too
    assert per_rank[1]["export"][layout] == ([], [])


@pytest.mark.multiprocess
def test_the_push_without_mtp_exports_everything_else(run):
    ckpt, _, per_rank = run
    language = {n for n in _stored(ckpt) if not n.startswith(("model.visual.", "mtp."))}
    names = per_rank[0]["export"]["pp2_no_mtp"]
    assert sorted(names) == sorted(language) and per_rank[1]["export"]["pp2_no_mtp"] == []


@pytest.mark.multiprocess
def test_pp2_last_stage_embedding_copy_equals_the_first(run):
    _, _, per_rank = run
    by_stage = dict(r["pp2_embedding"] for r in per_rank)
    assert set(by_stage) == {0, 1} and by_stage[1] is not None  # the last stage does hold a copy
    assert (by_stage[0] == by_stage[1]).all()  # loaded alike: either may be the one exported


@pytest.mark.multiprocess
def test_mtp_off_carries_mtp_through(run):
    ckpt, _, per_rank = run
    names, bad = per_rank[0]["export"]["mtp_off"]
    assert bad == [] and sorted(names) == sorted(n for n in _stored(ckpt) if not n.startswith(("model.visual.", "mtp.")))


@pytest.mark.multiprocess
def test_eh_proj_input_is_embedding_then_hidden(run):
    _, ref, per_rank = run
    got = torch.from_numpy(per_rank[0]["forward"]["eh_in"]).double()
    h = got.shape[-1] // 2
    want = ref["eh_in"]
    # first half: the normed embedding of token t+1 (positions with a next token): no fp32 depth behind it;
    # second half: the normed hidden after 4 fp32 layers (GDN included): the repo's relative logits bound
    assert (got[:, :-1, :h] - want[:, :-1, :h]).abs().max().item() <= 1e-5
    assert (got[..., h:] - want[..., h:]).abs().max().item() <= 1e-4 * max(1.0, want[..., h:].abs().max().item())
    assert (got[:, :-1, :h] - want[:, :-1, h:]).abs().max().item() > 0.1  # the halves are distinguishable


@pytest.mark.multiprocess
def test_mtp_logits_match_float64_reference(run):
    _, ref, per_rank = run
    for rank in (0, 1):  # DP=2: both replicas compute it
        got = torch.from_numpy(per_rank[rank]["forward"]["mtp_logits"]).double()[:, :-1]
        want = ref["mtp_logits"][:, :-1]
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.multiprocess
def test_sft_step_trains_mtp_under_the_loss_mask(run):
    _, ref, per_rank = run
    # MTP at position t predicts token t+2 and counts where the main loss counts position t+1
    ids = torch.load(run[0] / "ids.pt")
    target = torch.roll(ids, -1, 1)
    target = torch.cat([target[:, 1:], target[:, :1]], 1)[:, :-1]  # labels rolled once more (the last has none)
    ce = torch.nn.functional.cross_entropy(ref["mtp_logits"][:, :-1].transpose(1, 2), target, reduction="none")
    m = ref["mask"][:, 1:].double()
    per_row = (ce * m).sum(1) / m.sum(1)  # each DP rank holds one row; the ranks' means are averaged
    want = per_row.mean().item()
    assert abs(want - ce.mean().item()) > 1e-3  # the mask matters for this batch
    assert sorted(r["sft"]["dp_rank"] for r in per_rank) == [0, 1]
    for r in per_rank:
        assert abs(r["sft"]["mtp_loss"] - want) <= 1e-4 * want  # the loss before the update, same on every rank
        changed = r["sft"]["mtp_changed"]
        for name in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
                     "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"):
            assert name in changed  # the MTP loss reached them: MTP trains in SFT


@pytest.mark.multiprocess
def test_forward_without_labels_is_the_main_head(run):
    _, ref, per_rank = run
    got = torch.from_numpy(per_rank[0]["forward"]["main_logits"]).double()
    assert got.shape == ref["main_logits"].shape
    assert (got - ref["main_logits"]).abs().max().item() <= 1e-4 * max(1.0, ref["main_logits"].abs().max().item())


@pytest.mark.multiprocess
def test_grpo_update_leaves_frozen_mtp_as_loaded(run):
    _, _, per_rank = run
    for r in per_rank:
        g = r["grpo"]
        assert g["ok"] and g["mtp_params"] and g["frozen"] == g["mtp_params"]
        assert not set(g["changed"]) & set(g["mtp_params"])
        assert any(n.startswith("decoder.layers.") for n in g["changed"])  # the policy did move


@pytest.mark.multiprocess
def test_missing_mtp_tensor_is_named(run):
    _, _, per_rank = run
    for r in per_rank:
        assert "mtp.fc.weight" in r["missing"] and "missing" in r["missing"]
