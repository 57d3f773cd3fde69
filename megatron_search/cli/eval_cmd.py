"""`megatron-search eval`: compare checkpoints / endpoints on benchmarks with the budget protocol.

    megatron-search eval [config] [key=value ...] --model NAME=SPEC [--model ...] \\
        [--records qa.jsonl --split test] [--simpleqa simple_qa_test_set.csv] [--frames test.tsv] \\
        [--facts facts.jsonl] --index runs/index --out runs/eval [--budgets 0-10] [--limit N] \\
        [--variants budget,standard,abstention,tool_choice_none] [--price NAME=PRICE_ROW] [--sbs-baseline NAME]

SPEC is an engine URL (http://host:port: SGLang or `megatron-search` local engine server) or an
HF checkpoint directory (run in process on CPU). Defaults come from the `eval` config section
(RECIPE 8: only search_web, <= 5 calls, <= 10 results per call, <= 8192 output tokens,
temperature 0.6); eval.grader=llm with eval.judge_base_url uses the LLM judges. Results are appended
per example to <out>/results.jsonl: re-running the same command resumes. Outputs: report.json,
report.md (one table comparing every model), accuracy_vs_budget.png, accuracy_vs_cost.png (models
with --price), tb/ (TensorBoard). With --sbs-baseline, the pairs for `megatron-search rm eval --sbs`
are written per model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="benchmarks, budget sweep b=0..10, deployment metrics, cost, plots")
    add_config_args(p)
    p.add_argument("--model", action="append", default=[], metavar="NAME=SPEC", required=True,
                   help="a model to evaluate: engine URL or HF checkpoint dir (repeat to compare)")
    p.add_argument("--records", action="append", default=[], help="converted QA records (QARecord JSONL / parquet, or a Hub-layout / save_to_disk folder), e.g. the demo's qa.jsonl")
    p.add_argument("--split", default=None, help="split of --records to evaluate (e.g. test)")
    p.add_argument("--simpleqa", action="append", default=[],
                   help="SimpleQA CSV (metadata,problem,answer), or a local folder of it in the Hub's layout")
    p.add_argument("--frames", action="append", default=[],
                   help="FRAMES: the upstream TSV (Prompt, Answer), the CSV copy (question, true_answer), or a folder")
    p.add_argument("--facts", action="append", default=[], help="FACTS-style JSONL / parquet, or a folder")
    p.add_argument("--folder-split", default=None,
                   help="split to read from --simpleqa / --frames / --facts folders (default: a folder's only split)")
    p.add_argument("--index", default=None, help="local search index dir (default: the search config section)")
    p.add_argument("--corpus", default=None, help="corpus JSONL the abstention set withholds evidence from")
    p.add_argument("--out", required=True, help="run directory (results.jsonl, report, plots); reused = resume")
    p.add_argument("--budgets", default=None, help="e.g. 0-10 or 0,1,4 (default eval.budgets)")
    p.add_argument("--limit", type=int, default=None, help="examples per benchmark (deterministic sub-sample)")
    p.add_argument("--variants", default="budget", help="comma list of budget, standard, abstention, tool_choice_none")
    p.add_argument("--price", action="append", default=[], metavar="NAME=ROW", help="price-table row of a model")
    p.add_argument("--sbs-baseline", default=None, help="model NAME whose answers the others are compared with")
    p.add_argument("--no-language", action="store_true", help="skip the language-mismatch metric")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def parse_budgets(text: str) -> list[int]:
    """"0-10" -> 0..10; "0,1,4" -> [0, 1, 4]."""
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(x) for x in text.split("-"))
            if lo > hi:
                raise ValueError
            return list(range(lo, hi + 1))
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--budgets: expected a range like 0-10 or a list like 0,1,4, got {text!r}") from None
    if not out or min(out) < 0:
        raise ValueError(f"--budgets: need non-negative budgets, got {text!r}")
    return out


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag}: expected NAME=VALUE, got {item!r}")
        if name in out:
            raise ValueError(f"{flag}: {name!r} given twice")
        out[name] = value
    return out


def run(args: argparse.Namespace) -> int:
    from megatron_search.data.jsonl import DataError
    from megatron_search.eval import BenchmarkSpec, evaluate
    from megatron_search.search.base import SearchBackendError

    cfg = load_from_args(args)
    try:
        models = _pairs(args.model, "--model")
        prices = _pairs(args.price, "--price")
        unknown = sorted(set(prices) - set(models))
        if unknown:
            raise ValueError(f"--price: {unknown} are not among the --model names {sorted(models)}")
        if args.sbs_baseline is not None and args.sbs_baseline not in models:
            raise ValueError(f"--sbs-baseline {args.sbs_baseline!r} is not one of the --model names")
        specs = [BenchmarkSpec("records", p, args.split) for p in args.records]
        specs += [BenchmarkSpec(k, p, args.folder_split if Path(p).is_dir() else None)
                  for k in ("simpleqa", "frames", "facts") for p in getattr(args, k)]
        if not specs:
            raise ValueError("no benchmark given (--records / --simpleqa / --frames / --facts)")
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        budgets = parse_budgets(args.budgets) if args.budgets else None
        report = evaluate(cfg, models, specs, args.out, index_dir=args.index, corpus=args.corpus, budgets=budgets,
                          limit=args.limit, variants=variants, prices=prices, sbs_baseline=args.sbs_baseline,
                          language=not args.no_language, tensorboard=not args.no_tensorboard,
                          progress=not args.quiet)
    except (ValueError, DataError, FileNotFoundError, SearchBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, st in report["status"].items():
        print(f"{name}: {st['done']} new results, {st['skipped']} already on file, {len(st['errors'])} engine errors")
    print(open(report["outputs"]["markdown"], encoding="utf-8").read())
    for k, v in report["outputs"].items():
        print(f"{k}: {v}")
    return 1 if any(st["errors"] for st in report["status"].values()) else 0
