"""The budget protocol end to end with a scripted policy: curve values by hand, enforcement, variants,
resume after an interruption (finished examples are never asked again), report outputs."""
import json
import re

import pytest

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, QwenTokenizer
from megatron_search.config import load_config
from megatron_search.eval import BenchmarkSpec, evaluate
from megatron_search.eval.results import ResultStore
from megatron_search.rollout.local.scripted import ScriptedEngine
from megatron_search.search.local import LocalSearchBackend

QA = [  # id, question, answer, has a supporting document
    ("e1", "Which person founded Talbeck Works?", "Ivo Brand", True),
    ("e2", "Which river flows through Quarnby?", "Ellow", True),
    ("e3", "Which company published Dunmere Evening?", "Velde Press", True),
    ("e4", "Which painter restored the Marrow Chapel?", "Sela Dunn", False),
]
DOCS = [{"id": f"d-{i}", "title": a, "url": f"https://w.example/{i}", "text": f"{q[6:-1]}: {a}."}
        for i, q, a, has in QA if has]
DOCS.append({"id": "d-x", "title": "Lighthouse", "url": "https://w.example/x", "text": "A tall lighthouse by the sea."})
ABSTAIN = "I could not find reliable evidence."


@pytest.fixture(scope="module")
def tok():
    return QwenTokenizer()


class Policy:
    """Scripted search policy. Turn 1: with a budget > 0 (or tools disabled: it disobeys) two identical
    search calls, else an abstention. Turn 2: the title of the first result, or an abstention."""

    def __init__(self, tok, fail_after=None):
        self.tok, self.fail_after, self.episodes = tok, fail_after, 0

    def __call__(self, ids):
        text = self.tok.decode(ids)
        turn = text.count("<|im_start|>assistant")
        if turn == 1:
            self.episodes += 1
            if self.fail_after is not None and self.episodes > self.fail_after:
                raise KeyboardInterrupt("simulated interruption")
            question = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)[-1]
            if "budget of 0 tool calls" in text:
                out = ABSTAIN
            else:
                call = '<tool_call>\n{"name": "search_web", "arguments": {"query": "%s"}}\n</tool_call>' % question
                out = call + "\n" + call
        else:
            m = re.search(r"<tool_response>\n\[1\] (.*?)\n", text)
            out = m.group(1) if m else ABSTAIN
        return self.tok.encode(out + "<|im_end|>")


def write_set(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text("".join(json.dumps({"id": i, "question": q, "answers": [a], "source": "demo", "split": "test"}) + "\n"
                         for i, q, a, _ in QA))
    return p


def cfg_for(concurrency=4, temperature=0.6):
    return load_config(None, ["eval.max_new_tokens=256", f"rollout.concurrency={concurrency}", "eval.limit=0",
                              f"eval.temperature={temperature}"])


def run(tmp_path, tok, engine, out, variants=("budget",), budgets=(0, 1, 2), concurrency=4, temperature=0.6, **kw):
    enc = ChatEncoder(tok, ChatFormat("qwen3"))
    return evaluate(cfg_for(concurrency, temperature), {"policy": engine}, [BenchmarkSpec("records", str(write_set(tmp_path)), "test")],
                    out, backend=LocalSearchBackend.from_docs(DOCS), encoder=enc, budgets=list(budgets),
                    variants=variants, language=False, progress=False, **kw)


def test_budget_curve_by_hand(tmp_path, tok):
    policy = Policy(tok)
    out = tmp_path / "run"
    docs_path = tmp_path / "corpus.jsonl"
    docs_path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    rep = run(tmp_path, tok, ScriptedEngine(policy), out, variants=("budget", "abstention", "tool_choice_none"),
              corpus=str(docs_path), prices={"policy": "gpt-5"})
    curve = rep["budget_curve"]["policy"]["demo"]
    assert sorted(curve) == [0, 1, 2]
    # b = 0: the budget sentence reaches the policy, which abstains: nothing attempted, no calls
    assert curve[0]["accuracy"] == 0.0 and curve[0]["not_attempted"] == 1.0 and curve[0]["mean_tool_calls"] == 0.0
    # b >= 1: three of four questions have a document whose title is the answer
    for b in (1, 2):
        assert curve[b]["accuracy"] == 0.75 and curve[b]["mean_tool_calls"] == 2.0
    rows = list(ResultStore(out / "results.jsonl").rows(variant="budget"))
    # the limit is enforced in the loop: at b = 1 the second call of each episode is over budget
    assert {r["broken"]["over_budget"] for r in rows if r["budget"] == 1} == {1}
    assert {r["broken"]["over_budget"] for r in rows if r["budget"] == 2} == {0}
    # e4 has no document: its search finds nothing and the policy declines
    assert {(r["grade"], r["prediction"]) for r in rows if r["budget"] > 0 and r["id"] == "e4"} == {("NOT_ATTEMPTED", ABSTAIN)}
    # tokens, recomputed independently: b = 0 is one turn from the rendered prompt
    enc = ChatEncoder(tok, ChatFormat("qwen3"))
    from megatron_search.data.sft import SYSTEM_PROMPT
    from megatron_search.search.tool import SearchTool
    spec = SearchTool(LocalSearchBackend.from_docs(DOCS)).spec
    q1 = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QA[0][1]}]
    r0 = next(r for r in rows if r["budget"] == 0 and r["id"] == "e1")
    assert r0["tokens_in"] == len(enc.prompt_ids(q1, [spec], budget=0))
    assert r0["tokens_out"] == len(tok.encode(ABSTAIN + "<|im_end|>"))
    assert curve[0]["cents_per_query"] == pytest.approx(
        (curve[0]["mean_tokens_in"] * 1.25 + curve[0]["mean_tokens_out"] * 10.0) / 1e6 * 100)
    dep = rep["deployment"]["policy"]
    # broken calls over the sweep: 4 over-budget calls out of 4 * (0 + 2 + 2) calls
    assert dep["broken_tool_calls"]["count"]["over_budget"] == 4 and dep["broken_tool_calls"]["calls"] == 16
    assert dep["broken_tool_calls"]["rate_per_call"]["over_budget"] == 0.25
    # tool_choice=none: the policy calls anyway; every call is broken as tool_choice_none
    assert dep["tool_choice_none"]["episodes_calling"] == 1.0
    assert dep["broken_tool_calls_tool_choice_none"]["rate_per_call"]["tool_choice_none"] == 1.0
    # evidence withheld: only the distractor is left, searches find nothing, every answer declines
    assert dep["abstention"]["abstention_rate"] == 1.0
    for name in ("report.json", "report.md", "accuracy_vs_budget.png", "accuracy_vs_cost.png"):
        assert (out / name).is_file(), name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(out / "tb" / "policy"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("demo/accuracy")] == [(0, 0.0), (1, 0.75), (2, 0.75)]
    assert [e.value for e in ea.Scalars("demo/mean_tool_calls")] == [0.0, 2.0, 2.0]
    md = (out / "report.md").read_text()
    assert "| policy | 0.0 / " in md and "| 75.0 / " in md


def test_interrupted_run_resumes_without_reasking(tmp_path, tok):
    full = run(tmp_path, tok, ScriptedEngine(Policy(tok)), tmp_path / "straight", concurrency=1)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, tok, ScriptedEngine(Policy(tok, fail_after=5)), out, concurrency=1)
    done = len(ResultStore(out / "results.jsonl"))
    assert done == 5
    # a crash mid-append leaves a torn last line: it is dropped and that example runs again
    with open(out / "results.jsonl", "a") as f:
        f.write('{"model": "policy", "benchm')
    second = Policy(tok)
    rep = run(tmp_path, tok, ScriptedEngine(second), out, concurrency=1)
    assert second.episodes == 12 - 5
    assert rep["status"]["policy"] == {"done": 7, "skipped": 5, "errors": []}
    assert rep["budget_curve"] == full["budget_curve"]
    third = Policy(tok)
    run(tmp_path, tok, ScriptedEngine(third), out, concurrency=1)
    assert third.episodes == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(l) for l in lines)
    # results made under other settings are never mixed in
    with pytest.raises(ValueError, match="setting temperature: 0.6 on file, 1.0 now"):
        run(tmp_path, tok, ScriptedEngine(Policy(tok)), out, concurrency=1, temperature=1.0)


class Alternating(Policy):
    """Searches on odd episodes (then answers with the first result's title), declines on even ones."""

    def __call__(self, ids):
        text = self.tok.decode(ids)
        if text.count("<|im_start|>assistant") == 1 and self.episodes % 2 == 1:
            self.episodes += 1
            return self.tok.encode(ABSTAIN + "<|im_end|>")
        return super().__call__(ids)


def test_samples_average_episodes_with_their_own_seeds(tmp_path, tok):
    from megatron_search.eval.sweep import EvalJob, example_seed

    enc = ChatEncoder(tok, ChatFormat("qwen3"))

    def run_k(k, engine, out):
        cfg = load_config(None, ["eval.max_new_tokens=256", "rollout.concurrency=1", f"eval.samples={k}"])
        return evaluate(cfg, {"policy": engine}, [BenchmarkSpec("records", str(write_set(tmp_path)), "test")], out,
                        backend=LocalSearchBackend.from_docs(DOCS), encoder=enc, budgets=[1], language=False,
                        progress=False)

    policy = Alternating(tok)
    engine = ScriptedEngine(policy)
    rep = run_k(2, engine, tmp_path / "k2")
    # one job per (example, sample), samples of an example in a row: sample 0 searches (3 of 4 examples have
    # a document whose title is the answer), sample 1 declines -> 3 correct of 8 episodes
    assert rep["budget_curve"]["policy"]["demo"][1]["accuracy"] == 3 / 8
    rows = list(ResultStore(tmp_path / "k2" / "results.jsonl").rows(variant="budget"))
    assert sorted((r["id"], r["sample"]) for r in rows) == [(i, s) for i, *_ in QA for s in (0, 1)]
    first = [r for r in engine.requests if tok.decode(list(r.input_ids)).count("<|im_start|>assistant") == 1]
    assert len(first) == 8 and len({r.sampling.seed for r in first}) == 8
    # sample 0 keeps the seed of a single-sample run; later samples get their own
    ex = load_benchmark_examples(tmp_path)
    s0 = example_seed(0, EvalJob(ex[0], "budget", 1))
    s1 = example_seed(0, EvalJob(ex[0], "budget", 1, sample=1))
    single = ScriptedEngine(Policy(tok))
    run_k(1, single, tmp_path / "k1")
    turn_seed = lambda r: r.sampling.seed // 1000  # noqa: E731 (the agent seeds turn t with seed * 1000 + t)
    assert turn_seed(single.requests[0]) == s0 == turn_seed(engine.requests[0])
    assert s1 != s0
    # raising k on the same directory runs only the new samples
    more = Policy(tok)
    rep3 = run_k(3, ScriptedEngine(more), tmp_path / "k2")
    assert more.episodes == 4 and rep3["status"]["policy"]["skipped"] == 8
    assert rep3["budget_curve"]["policy"]["demo"][1]["accuracy"] == 6 / 12


def load_benchmark_examples(tmp_path):
    from megatron_search.eval.benchmarks import load_benchmark

    return load_benchmark("records", write_set(tmp_path), split="test")


def test_standard_variant_states_no_budget(tmp_path, tok):
    """The standard protocol: the training prompt (no budget sentence), the tool's default call limit."""
    engine = ScriptedEngine(Policy(tok))
    rep = run(tmp_path, tok, engine, tmp_path / "std", variants=("standard",), budgets=())
    std = rep["deployment"]["policy"]["standard"]["demo"]
    # no budget sentence reaches the policy, so it searches twice; 3 of 4 questions have a document
    assert std["accuracy"] == 0.75 and std["mean_tool_calls"] == 2.0 and std["n"] == 4
    assert not any("budget" in tok.decode(list(r.input_ids)) for r in engine.requests)
    assert rep["budget_curve"] == {}
    rows = list(ResultStore(tmp_path / "std" / "results.jsonl").rows())
    assert {(r["variant"], r["budget"]) for r in rows} == {("standard", None)}
    assert "demo: accuracy, no stated budget" in (tmp_path / "std" / "report.md").read_text()
