"""`evaluate(...)`: one eval run over several models/checkpoints and benchmarks, resumable.

    from megatron_search.eval import evaluate, BenchmarkSpec
    report = evaluate(cfg, {"sft": "runs/demo/hf", "ref": "http://127.0.0.1:30000"},
                      [BenchmarkSpec("records", "runs/demo/qa.jsonl", split="test", name="demo")],
                      out_dir="runs/eval", index_dir="runs/index")

Models: an `Engine` object, an engine URL (SGLang or the local engine server: same API), or an
HF checkpoint directory (in-process LocalEngine). Search: `index_dir` (local bm25s index) or
`backend`, else cfg.search. Every result is appended to <out_dir>/results.jsonl as it finishes;
calling again with the same out_dir asks only what is missing, then rewrites the report, the
plots and the TensorBoard scalars from all results on file. The write-up's reference points
(eval/reference_points.yaml, or `references=PATH`; None leaves them out) are placed beside ours for the
benchmarks both have.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, load_tokenizer
from megatron_search.data.jsonl import atomic_write_json, write_jsonl
from megatron_search.data.sft import SYSTEM_PROMPT
from megatron_search.rollout.agent.loop import AgentSettings, SearchAgent
from megatron_search.rollout.engine.auth import key_from_env
from megatron_search.rollout.engine.base import Engine
from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.rollout.vllm.client import VLLMClient
from megatron_search.search import build_backend
from megatron_search.search.base import SearchBackend
from megatron_search.search.local import LocalSearchBackend, read_corpus
from megatron_search.search.tool import SearchTool

from .benchmarks import EvalExample, load_benchmark, write_examples
from .cost import load_prices
from .graders import build_grader
from .metrics import (LanguageID, abstention, broken_tool_calls, budget_curve, group, language_mismatch, sbs_metric,
                      sbs_rows, summarize, tool_choice_none_rate, withhold_evidence)
from .references import DEFAULT_REFERENCES, load_references
from .report import add_costs, build_report, write_outputs
from .results import ResultStore
from .sweep import VARIANTS, budget_jobs, run_jobs, variant_jobs

log = logging.getLogger(__name__)
ModelSpec = Union[Engine, str]


@dataclass(frozen=True)
class BenchmarkSpec:
    kind: str  # benchmarks.KINDS
    path: str
    split: Optional[str] = None
    name: Optional[str] = None


def open_engine(spec: ModelSpec, cfg) -> tuple[Engine, bool]:
    """(engine, whether we created it and must close it)."""
    if isinstance(spec, Engine):
        return spec, False
    if spec.startswith(("http://", "https://")):
        if cfg.rollout.engine == "vllm":  # engine URLs speak the API of rollout.engine
            return VLLMClient(spec, cfg.rollout.vllm.request_timeout_s,
                              api_key=key_from_env(cfg.rollout.api_key_env)), True
        return SGLangClient(spec, timeout_s=cfg.rollout.sglang.request_timeout_s,
                            api_key=key_from_env(cfg.rollout.api_key_env)), True
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"model {spec!r}: neither an engine URL (http://...) nor an HF checkpoint directory "
                         "(no config.json)")
    from megatron_search.rollout.local.engine import (LocalEngine)  # start-up: transformers (0.6 s), only for an HF dir model

    lc = cfg.rollout.local
    return LocalEngine(spec, dtype=lc.dtype or cfg.model.params_dtype, seed=lc.seed,
                       max_running_requests=lc.max_running_requests,
                       prefix_cache_entries=lc.prefix_cache_entries), True


def _backend(search, index_dir: Optional[str], backend: Optional[SearchBackend]) -> SearchBackend:
    """`backend`, or a local index at `index_dir`, or the backend a SearchConfig names."""
    if backend is not None:
        return backend
    if index_dir is not None:
        return LocalSearchBackend.load(index_dir, search.snippet_chars)
    return build_backend(search)


def _corpus_docs(search, index_dir: Optional[str], corpus: Optional[str]) -> list[dict]:
    """The documents the abstention set withholds from (a local index's docs.jsonl, or a corpus JSONL)."""
    if corpus is not None:
        return list(read_corpus(corpus))
    idx = index_dir or search.index_dir
    if idx is not None and (Path(idx) / "docs.jsonl").is_file():
        with open(Path(idx) / "docs.jsonl", encoding="utf-8") as f:
            return [json.loads(l) for l in f if l.strip()]
    if search.corpus is not None:
        return list(read_corpus(search.corpus))
    raise ValueError("abstention: needs the corpus (a local index dir with docs.jsonl, or a corpus JSONL) to "
                     "withhold evidence from")


def _spec_text(spec: ModelSpec) -> str:
    if isinstance(spec, Engine):
        return f"{type(spec).__name__}:{getattr(spec, 'model_path', '')}"
    return str(spec)


def check_manifest(out: Path, models: dict[str, ModelSpec], settings: dict) -> None:
    """Refuse to mix results made under different settings or by a different model under the same name.

    <out>/run.json records each model name's spec and the settings that change results; a re-run
    (resume) must match them, so a reused name never silently adds up answers of two checkpoints.
    """
    path = out / "run.json"
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"models": {}, "settings": settings}
    problems = [f"setting {k}: {old['settings'].get(k)!r} on file, {v!r} now" for k, v in settings.items()
                if old["settings"].get(k) != v]
    specs = {name: _spec_text(spec) for name, spec in models.items()}
    problems += [f"model {n!r}: {old['models'][n]!r} on file, {s!r} now" for n, s in specs.items()
                 if n in old["models"] and old["models"][n] != s]
    if problems:
        raise ValueError(f"{out} holds results of a different run ({'; '.join(problems)}); use another --out "
                         "directory or another model name")
    atomic_write_json(path, {"models": {**old["models"], **specs}, "settings": settings})


def load_sets(specs: Sequence[BenchmarkSpec], limit: int, seed: int) -> list[EvalExample]:
    examples: list[EvalExample] = []
    for s in specs:
        examples += load_benchmark(s.kind, s.path, limit, seed, s.split, s.name)
    names = [e.benchmark for e in examples]
    if len({(e.benchmark, e.id) for e in examples}) != len(examples):
        raise ValueError(f"benchmarks: two sets share a name and example ids ({sorted(set(names))}); "
                         "give them distinct names")
    return examples


def evaluate(*args, **kwargs) -> dict:
    """Synchronous `evaluate_async` (its own event loop); from inside a running loop await `evaluate_async`."""
    return asyncio.run(evaluate_async(*args, **kwargs))


async def evaluate_async(cfg, models: dict[str, ModelSpec], benchmarks: Sequence[BenchmarkSpec], out_dir: str | Path, *,
                         index_dir: Optional[str] = None, backend: Optional[SearchBackend] = None, corpus: Optional[str] = None,
                         budgets: Optional[Sequence[int]] = None, limit: Optional[int] = None,
                         variants: Sequence[str] = ("budget",), encoder=None, grader=None,
                         system_prompt: Optional[str] = None, prices: Optional[dict[str, str]] = None,
                         sbs_baseline: Optional[str] = None, sbs_scorer=None, sbs_budget: Optional[int] = None,
                         language: bool = True, tensorboard: bool = True, progress: bool = True,
                         references: Optional[str | Path] = DEFAULT_REFERENCES) -> dict:
    """Run (or resume) the eval and write the report; returns the report dict (see module docstring).

    variants: any of "budget" (the b sweep), "standard" (no stated budget, <= eval.max_calls calls),
    "abstention", "tool_choice_none". prices: model name ->
    row of the price table (eval.prices). sbs: with `sbs_scorer` (an rm RMScorer) and `sbs_baseline`
    (one of `models`), each other model's answers at b = `sbs_budget` (default: the largest b) are
    compared with the baseline's; without a scorer the pairs are written to sbs_<model>_vs_<baseline>.jsonl for
    `megatron-search rm eval --sbs`. references: the write-up's reference-point file (None: none shown).
    """
    ec = cfg.eval
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        raise ValueError(f"evaluate: unknown variant(s) {bad}")
    if not models:
        raise ValueError("evaluate: no models given")
    budgets = list(ec.budgets if budgets is None else budgets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_sets(benchmarks, ec.limit if limit is None else limit, ec.seed)
    write_examples(out / "examples.jsonl", examples)
    system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
    encoder = encoder or ChatEncoder(load_tokenizer(cfg.model.tokenizer), ChatFormat(cfg.model.chat_style))
    own_grader = grader is None
    grader = grader or build_grader(ec)
    check_manifest(out, models, {
        "max_calls": ec.max_calls, "max_results": ec.max_results, "max_new_tokens": ec.max_new_tokens,
        "temperature": ec.temperature, "seed": ec.seed, "grader": ec.grader, "judge_model": ec.judge_model,
        "system_prompt": system_prompt, "chat_style": cfg.model.chat_style, "max_turns": cfg.rollout.max_turns,
    })
    store = ResultStore(out / "results.jsonl")
    base_backend = _backend(cfg.search, index_dir, backend)
    tool = SearchTool(base_backend, ec.max_results, cfg.search.max_query_chars, ec.max_calls)
    withheld_tool = None
    if "abstention" in variants:
        kept, removed = withhold_evidence(_corpus_docs(cfg.search, index_dir, corpus), examples)
        log.info("abstention: withheld %d evidence documents, %d left", len(removed), len(kept))
        withheld_tool = SearchTool(LocalSearchBackend.from_docs(kept, cfg.search.snippet_chars), ec.max_results,
                                   cfg.search.max_query_chars, ec.max_calls)
    settings = AgentSettings.for_eval(cfg)
    n = ec.samples
    jobs_main = budget_jobs(examples, budgets, n) if "budget" in variants else []
    jobs_std = variant_jobs(examples, "standard", n) if "standard" in variants else []
    jobs_none = variant_jobs(examples, "tool_choice_none", n, "none") if "tool_choice_none" in variants else []
    jobs_abst = variant_jobs(examples, "abstention", n) if "abstention" in variants else []
    status = {}

    async def run_model(name: str, spec: ModelSpec) -> dict:
        every = jobs_main + jobs_std + jobs_none + jobs_abst
        if all(j.key(name) in store for j in every):  # nothing left to ask: do not even load the model
            return {"done": 0, "skipped": len(every), "errors": []}
        engine, owned = open_engine(spec, cfg)
        try:
            st = await run_jobs(name, SearchAgent(engine, encoder, tool, settings), grader, jobs_main + jobs_std + jobs_none,
                                store, system_prompt, ec.seed, progress)
            if jobs_abst:
                sa = await run_jobs(name, SearchAgent(engine, encoder, withheld_tool, settings), grader, jobs_abst,
                                    store, system_prompt, ec.seed, progress)
                st = {k: st[k] + sa[k] for k in st}
            return st
        finally:
            if owned:
                await engine.close()

    async def run_all() -> None:
        try:
            for name, spec in models.items():
                status[name] = await run_model(name, spec)
        finally:
            client = getattr(grader, "client", None) if own_grader else None  # a caller's grader stays open
            if client is not None:
                await client.close()

    await run_all()
    return make_report(cfg.eval, store, out, list(models), variants, prices or {}, sbs_baseline, sbs_scorer,
                       sbs_budget if sbs_budget is not None else (max(budgets) if budgets else None),
                       language, tensorboard, status, references=references)


def make_report(ec, store: ResultStore, out: Path, models: list[str], variants: Sequence[str],
                prices: dict[str, str], sbs_baseline: Optional[str], sbs_scorer, sbs_budget: Optional[int],
                language: bool, tensorboard: bool, status: Optional[dict] = None,
                references: Optional[str | Path] = DEFAULT_REFERENCES) -> dict:
    """Aggregate every result of `models` on file into the report and write the outputs (`ec`: the EvalConfig)."""
    rows = [r for r in store.rows() if r["model"] in models]
    curve = budget_curve(rows)
    table = load_prices(ec.prices)
    unknown = sorted(set(prices.values()) - set(table))
    if unknown:
        raise ValueError(f"prices: no row {unknown} in the price table (have {sorted(table)})")
    model_prices = {m: table[p] for m, p in prices.items()}
    add_costs(curve, model_prices)
    lid = LanguageID(ec.languages, ec.min_language_chars, ec.language_min_confidence) if language else None
    deployment: dict = {}
    for m in models:
        d: dict = {}
        main = [r for r in rows if r["model"] == m and r["variant"] == "budget"]
        if main:
            d["broken_tool_calls"] = broken_tool_calls(main)
            if lid is not None:
                d["language_mismatch"] = language_mismatch(main, lid)
        std = [r for r in rows if r["model"] == m and r["variant"] == "standard"]
        if std:
            d["standard"] = {bench: summarize(g) for (bench,), g in group(std, "benchmark").items()}
        none_rows = [r for r in rows if r["model"] == m and r["variant"] == "tool_choice_none"]
        if none_rows:
            d["tool_choice_none"] = tool_choice_none_rate(none_rows)
            d.setdefault("broken_tool_calls_tool_choice_none", broken_tool_calls(none_rows))
        abst = [r for r in rows if r["model"] == m and r["variant"] == "abstention"]
        if abst:
            d["abstention"] = abstention(abst)
        if sbs_baseline is not None and m != sbs_baseline:
            pairs = sbs_rows(rows, m, sbs_baseline, "budget", sbs_budget)
            if pairs:
                if sbs_scorer is not None:
                    d["sbs"] = {**sbs_metric(sbs_scorer, pairs), "baseline": sbs_baseline, "budget": sbs_budget}
                else:
                    path = out / f"sbs_{m}_vs_{sbs_baseline}.jsonl"
                    write_jsonl(path, pairs)
                    d["sbs_pairs"] = str(path)
        deployment[m] = d
    report = build_report(out.name, curve, deployment, model_prices, {
        "models": models, "variants": list(variants), "results": len(rows),
        "eval_config": ec.model_dump(), "status": status or {},
    }, load_references(references) if references is not None else None)
    report["outputs"] = write_outputs(report, out, tensorboard)
    return report
