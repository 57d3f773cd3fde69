"""Spawned worker for tests/test_rm_train.py (Megatron needs its own process).

Trains a tiny pointwise RM on the synthetic cite-rule set, then records: held-out accuracy,
exact antisymmetry of P_bar (pointwise and pairwise scorers), the GRPO service's s for cited /
uncited / identical answers, a reload of the checkpoint, init of a new RM from it, and the
TensorBoard tags. Results go to a JSON file the test reads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def _tokenizer(pairs, out: Path) -> str:
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer

    fmt = ChatFormat("qwen3")
    texts = [fmt.render(p.messages + [{"role": "assistant", "content": y}]) for p in pairs
             for y in (p.answer_a, p.answer_b)]
    return str(BPETokenizer.train(texts, vocab_size=512, min_frequency=2).save(out / "tok"))


def _hf_policy(cfg, out: Path) -> tuple[Path, torch.Tensor]:
    """A random HF policy of the tiny config saved as safetensors, and its input embedding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(str(cfg.model.resolved_hf_config()))
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out, model.get_input_embeddings().weight.detach().clone()


def _tb_tags(log_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return sorted(acc.Tags()["scalars"])


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, init_distributed
    from megatron_search.rm.build import build_scorer, load_encoder
    from megatron_search.rm.scorer import PairEncoder, RMScorer
    from megatron_search.rm.service import PreferenceService
    from megatron_search.rm.synthetic import split_pairs, synthetic_pairs
    from megatron_search.rm.train import RMTrainer, train_rm

    out = Path(out_dir)
    pairs = synthetic_pairs(200, seed=3)
    train, held = split_pairs(pairs, 0.3, seed=0)
    overrides = [f"model.tokenizer={_tokenizer(pairs, out)}", "parallel.world_size=1", f"run.output_dir={out / 'run'}",
                 "rm.steps=8", "rm.global_batch_pairs=8", "rm.micro_batch_pairs=4", "rm.score_batch_pairs=64",
                 "optim.lr=2e-3", "rm.max_length=96", "checkpoint.save_interval=4", "logging.progress_bars=false",
                 "reward.scorer=pointwise"]
    cfg = load_config(None, overrides)
    ctx = init_distributed(cfg, env=DistEnv(rank, world, rank, "127.0.0.1", port, "single"))
    r: dict = {"train_pairs": len(train), "held_out_pairs": len(held)}
    encoder, pad_id = load_encoder(cfg)
    trainer = RMTrainer(cfg, ctx)
    res = train_rm(trainer, train, held, encoder, pad_id, progress=False, log=lambda s: None)
    r["eval"], r["train"], r["checkpoint"] = res["eval"], res["train"], res["checkpoint"]

    # exact antisymmetry of the permutation-averaged score, pointwise and pairwise
    scorer = RMScorer(trainer.model, encoder, pad_id, 32, groups=ctx.groups)
    x = [p.messages for p in held]
    a, b = [p.answer_a for p in held], [p.answer_b for p in held]
    p_ab, p_ba = scorer.p_bar(x, a, b), scorer.p_bar(x, b, a)
    r["pointwise_antisymmetric"] = bool(torch.equal(p_ab + p_ba, torch.ones_like(p_ab)))
    pair_scorer = RMScorer(trainer.model, PairEncoder(encoder.tokenizer, encoder.fmt, "pairwise", 192), pad_id, 32,
                           groups=ctx.groups)
    d_ab, d_ba = pair_scorer.deltas(x[:16], a[:16], b[:16])
    q_ab, q_ba = pair_scorer.p_bar(x[:16], a[:16], b[:16]), pair_scorer.p_bar(x[:16], b[:16], a[:16])
    r["pairwise_raw_position_bias"] = float((d_ab + d_ba).abs().max())  # Delta(a,b) != -Delta(b,a) in general
    r["pairwise_antisymmetric"] = bool(torch.equal(q_ab + q_ba, torch.ones_like(q_ab)))
    r["pairwise_in_unit_interval"] = bool(((q_ab >= 0) & (q_ab <= 1)).all())

    # the GRPO service: s = P_bar(x, y, y_ref) against the reference answer
    service = PreferenceService(scorer)
    cited = [p.answer_a if p.label else p.answer_b for p in held[:12]]
    plain = [p.answer_b if p.label else p.answer_a for p in held[:12]]
    ref = plain  # the reference model answered without citing
    s_cited = service.score(x[:12], cited, ref)
    s_plain = service.score(x[:12], plain, ref)
    s_mixed = service.score(x[:12], cited[:6] + plain[6:], ref)
    r["s_cited"], r["s_plain"], r["s_mixed"] = s_cited.tolist(), s_plain.tolist(), s_mixed.tolist()
    r["s_dtype"] = str(s_cited.dtype)

    # reload the checkpoint into a fresh RM; init a new RM's backbone from it (policy-init path)
    loaded = build_scorer(load_config(None, overrides + [f"rm.load={out / 'run' / 'checkpoints'}"]), ctx.groups)
    r["reload_max_diff"] = float((loaded.p_bar(x, a, b) - p_ab).abs().max())
    try:
        build_scorer(load_config(None, overrides + [f"rm.load={out / 'run' / 'checkpoints'}", "reward.scorer=pairwise"]),
                     ctx.groups)
        r["kind_mismatch_error"] = ""
    except ValueError as e:
        r["kind_mismatch_error"] = str(e)
    fresh = RMTrainer(load_config(None, overrides + [f"rm.init_from={res['checkpoint']}"]), ctx)
    tb = dict(trainer.model[0].backbone.named_parameters())
    fb = dict(fresh.model[0].backbone.named_parameters())
    r["init_backbone_equal"] = all(torch.equal(tb[k], fb[k]) for k in tb)
    r["init_head_fresh"] = not torch.equal(trainer.model[0].value_head.linear.weight,
                                           fresh.model[0].value_head.linear.weight)
    r["init_note"] = fresh.init_note
    # init from an HF policy checkpoint (safetensors written by transformers for the tiny config)
    hf_dir, hf_embed = _hf_policy(cfg, out / "hf_policy")
    from_hf = RMTrainer(load_config(None, overrides + [f"rm.init_from={hf_dir}"]), ctx)
    emb = from_hf.model[0].backbone.embedding.word_embeddings.weight
    r["hf_init_embedding_equal"] = bool(torch.equal(emb, hf_embed))
    r["hf_init_note"] = from_hf.init_note
    r["checkpoints"] = sorted(p.name for p in (out / "run" / "checkpoints").iterdir())
    r["tb_tags"] = _tb_tags(out / "run" / "tensorboard")
    ctx.teardown()
    (out / "result.json").write_text(json.dumps(r, indent=1))
