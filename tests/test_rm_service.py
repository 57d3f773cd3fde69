"""The GRPO-side pieces of the preference service without a model: the PreferenceScorer
signature is pinned, bad calls fail clearly, and reference answers come from the search agent on
a (scripted) frozen engine once per prompt, cached on disk."""
import inspect

import pytest
import torch

from megatron_search.rewards.preference import PreferenceScorer
from megatron_search.rm.service import PreferenceService, ReferenceCache, agent_reference_generator


def test_service_signature_matches_the_grpo_protocol():
    want = inspect.signature(PreferenceScorer.score)
    got = inspect.signature(PreferenceService.score)
    assert list(got.parameters) == list(want.parameters) == ["self", "prompts", "answers", "ref_answers"]
    assert str(got.return_annotation) == str(want.return_annotation)


class _Recorder:
    """Stands in for RMScorer: P_bar = 1 when the answer is longer than the reference, else 0 (or 1/2)."""

    def __init__(self):
        self.calls = []

    def p_bar(self, x, a, b):
        self.calls.append((x, a, b))
        return torch.tensor([0.5 if len(u) == len(v) else float(len(u) > len(v)) for u, v in zip(a, b)],
                            dtype=torch.float64)


def test_service_forwards_batches_and_checks_input():
    rec = _Recorder()
    svc = PreferenceService(rec)
    q = [{"role": "user", "content": "q"}]
    s = svc.score([q, q, q], ["long answer", "", "abc"], ["short", "x", "xyz"])
    assert s.dtype == torch.float32 and s.tolist() == [1.0, 0.0, 0.5]
    assert len(rec.calls) == 1  # one batched call for the whole step
    assert svc.score([], [], []).shape == (0,)
    with pytest.raises(ValueError, match="2 prompts, 1 answers, 1 reference answers"):
        svc.score([q, q], ["a"], ["b"])
    with pytest.raises(ValueError, match="item 0: answer and reference answer must be strings"):
        svc.score([q], [None], ["b"])


def test_reference_answers_from_the_agent_once_per_prompt(tmp_path):
    from megatron_search.rollout.agent.loop import AgentSettings, SearchAgent
    from megatron_search.chat.format import ChatFormat
    from megatron_search.rollout.local.scripted import ScriptedEngine
    from megatron_search.chat.tokenizer import ChatEncoder, QwenTokenizer
    from megatron_search.search.base import SearchBackend
    from megatron_search.search.tool import SearchTool

    tok = QwenTokenizer()

    class NoSearch(SearchBackend):
        name = "none"

        def search(self, query, k):
            raise AssertionError("the scripted reference answers without searching")

    def responder(ids):
        text = tok.decode(ids)
        return tok.encode(("Paris." if "France" in text else "Rome.") + "<|im_end|>")

    engine = ScriptedEngine(responder)
    agent = SearchAgent(engine, ChatEncoder(tok, ChatFormat("qwen3")), SearchTool(NoSearch()),
                        AgentSettings(max_new_tokens=32, max_total_tokens=2048, max_turns=2))
    cache = ReferenceCache(tmp_path / "refs.jsonl", agent_reference_generator(agent, seed=0))
    fr = [{"role": "user", "content": "Capital of France?"}]
    it = [{"role": "user", "content": "Capital of Italy?"}]
    refs = cache.get([fr, it, fr])
    assert [r.answer for r in refs] == ["Paris.", "Rome.", "Paris."]
    assert refs[0].generated_tokens == len(tok.encode("Paris.<|im_end|>"))
    assert len(engine.requests) == 2
    assert [r.answer for r in cache.get([it])] == ["Rome."] and len(engine.requests) == 2
    assert [r.answer for r in ReferenceCache(tmp_path / "refs.jsonl", lambda p, k: []).get([it, fr])] == ["Rome.", "Paris."]
