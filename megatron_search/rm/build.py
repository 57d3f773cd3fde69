"""Wiring from the config: the text encoder, a loaded reward model's scorer, the GRPO service."""
from __future__ import annotations

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import load_tokenizer

from .model import build_reward_model_chunks
from .scorer import PairEncoder, RMScorer
from .service import PreferenceService
from .train import load_rm_weights, rm_checkpoint


def load_encoder(cfg) -> tuple[PairEncoder, int]:
    """(PairEncoder, pad id) from model.tokenizer / model.chat_style / reward.scorer / rm.max_length."""
    tok = load_tokenizer(cfg.model.tokenizer)
    vocab = cfg.model.architecture.vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"model.tokenizer: {cfg.model.tokenizer!r} has {tok.vocab_size} ids but the model "
                         f"({cfg.model.hf_config}) embeds only {vocab}; use the model's tokenizer")
    return PairEncoder(tok, ChatFormat(cfg.model.chat_style), cfg.reward.scorer, cfg.rm.max_length), tok.pad_id


def build_scorer(cfg, groups, chunks: list | None = None) -> RMScorer:
    """An RMScorer on `chunks`, or on RM chunks built in `groups` and loaded from rm.load (model parallel state
    must exist)."""
    if chunks is None:
        if not cfg.rm.load:
            raise ValueError("rm.load: no trained reward model given (set rm.load=<RM checkpoint>)")
        rm_checkpoint(cfg.rm.load, kind=cfg.reward.scorer)  # fail before building the model
        chunks = build_reward_model_chunks(cfg, groups)
        load_rm_weights(chunks, cfg.rm.load, kind=cfg.reward.scorer)
    encoder, pad_id = load_encoder(cfg)
    seq_multiple = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    return RMScorer(chunks, encoder, pad_id, 2 * cfg.rm.score_batch_pairs, seq_multiple, groups=groups)


def preference_service(cfg, groups, chunks: list | None = None):
    """The GRPO loop's PreferenceService (rewards/preference.PreferenceScorer) for cfg."""
    return PreferenceService(build_scorer(cfg, groups, chunks))
