"""`megatron-search data ...`: build the embedded world, synthetic QA, SFT data, the RL prompt mix,
public-set conversions and rubric data. Every output is JSONL written atomically; synth and mix resume."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="build RL/SFT data: world, synth, sft, mix, convert, rubrics")
    dsub = p.add_subparsers(dest="data_command", metavar="STEP")
    dsub.required = True

    w = dsub.add_parser("world", help="generate the embedded synthetic world (corpus.jsonl + world.json)")
    add_config_args(w)
    w.add_argument("--out", required=True, help="output directory")
    w.set_defaults(func=run_world)

    s = dsub.add_parser("synth", help="synthetic multi-hop QA by sequential expansion (resumable)")
    add_config_args(s)
    s.add_argument("--world", help="world directory (corpus + ground truth for the uniqueness check)")
    s.add_argument("--corpus", help="any corpus JSONL in the world's language (no ground-truth check)")
    s.add_argument("--work", required=True, help="work directory holding per-stage outputs (resume point)")
    s.add_argument("--out", required=True, help="QA JSONL output")
    s.set_defaults(func=run_synth)

    f = dsub.add_parser("sft", help="SFT trajectories with real search_web calls + preference-oriented examples")
    add_config_args(f)
    f.add_argument("--world", required=True, help="world directory")
    f.add_argument("--qa", required=True, help="synthetic QA JSONL (from `data synth`), or a folder of QA records")
    f.add_argument("--out", required=True)
    f.add_argument("--instruction", type=int, default=None, help="instruction-following examples (default: data.sft)")
    f.add_argument("--abstention", type=int, default=None, help="abstention examples (default: data.sft)")
    f.set_defaults(func=run_sft)

    m = dsub.add_parser("mix", help="draw RL prompts from the QA / rubric mix (resumable with --state)")
    add_config_args(m)
    m.add_argument("--qa", required=True, nargs="+",
                   help="QA file(s) or folder(s) in the common record schema (JSONL, parquet, Arrow, Hub layout)")
    m.add_argument("--rubric", nargs="*", default=[], help="rubric chat JSONL file(s) or folder(s)")
    m.add_argument("-n", "--num", type=int, required=True, help="prompts to draw")
    m.add_argument("--state", help="sampler state JSON: loaded when present, saved after drawing")
    m.add_argument("--out", required=True)
    m.set_defaults(func=run_mix)

    c = dsub.add_parser("convert", help="public QA sets -> common record schema, quality-filtered")
    add_config_args(c)
    c.add_argument("--input", nargs="+", required=True, metavar="SOURCE=PATH",
                   help="training files or folders (Hub layout / save_to_disk), e.g. deepdive=dd.parquet "
                        "bamboogle=bamboogle.csv webshaper=./WebShaper")
    c.add_argument("--eval", nargs="*", default=[], metavar="SOURCE=PATH",
                   help="evaluation files (simpleqa=..., frames=...): their questions are removed from training")
    c.add_argument("--split", default=None, help="split of the --input folders to read (default: each one's only split)")
    c.add_argument("--eval-split", default=None, help="split of the --eval folders to read (default: the only split)")
    c.add_argument("--streaming", action="store_true",
                   help="stream the inputs (no Arrow copy in the datasets cache; for sets larger than memory or disk)")
    c.add_argument("--out", required=True, help="converted, filtered training records (JSONL)")
    c.add_argument("--eval-out", help="also write the converted evaluation records here")
    c.add_argument("--synthetic", help="synthetic QA JSONL to match to the public mix's scale")
    c.add_argument("--synthetic-out", help="where the scale-matched synthetic sample goes")
    c.set_defaults(func=run_convert)

    r = dsub.add_parser("rubrics", help="rubric chat data: generate, validate, sample x4, judge, pass@4 filter")
    add_config_args(r)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="chat JSONL rows {id, messages[, rubrics]} (rubrics missing: an LLM writes them)")
    src.add_argument("--demo", type=int, metavar="N", help="N embedded demo prompts with checkable rubrics (needs --world)")
    r.add_argument("--world", help="world directory (for --demo)")
    r.add_argument("--no-calibration", action="store_true",
                   help="skip the pass@4 filter (no policy endpoint needed); rows are marked uncalibrated")
    r.add_argument("--out", required=True, help="kept prompts with rubrics (JSONL)")
    r.add_argument("--dropped", help="dropped prompts with stage and reason (JSONL)")
    r.set_defaults(func=run_rubrics)


def _progress() -> bool:
    return sys.stderr.isatty()


def _clean_errors(fn):
    """Bad input (data, LLM endpoint, search index) ends the command with one clear line, exit code 2."""
    import functools

    @functools.wraps(fn)
    def run(args) -> int:
        from megatron_search.data.jsonl import DataError
        from megatron_search.data.llm_client import LLMError, LLMOutputError
        from megatron_search.search.base import SearchBackendError

        try:
            return fn(args)
        except (DataError, LLMError, LLMOutputError, SearchBackendError, FileNotFoundError) as e:
            print(f"error: data {args.data_command}: {e}", file=sys.stderr)
            return 2
    return run


@_clean_errors
def run_world(args) -> int:
    from megatron_search.data.world import build_world

    c = load_from_args(args).data.world
    world = build_world(c.seed, c.num_entities, c.min_sources, c.single_source_fraction, c.rumor_fraction,
                        c.filler_docs, progress=_progress())
    world.save(args.out)
    print(f"world: {len(world.entities)} entities, {len(world.facts)} facts, {len(world.documents)} documents -> {args.out}")
    return 0


@_clean_errors
def run_synth(args) -> int:
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.synth.pipeline import SynthPipeline
    from megatron_search.data.world import World
    from megatron_search.search.local import LocalSearchBackend, read_corpus

    cfg = load_from_args(args).data.synth
    if bool(args.world) == bool(args.corpus):
        raise SystemExit("data synth: give exactly one of --world DIR or --corpus FILE")
    world = World.load(args.world) if args.world else None
    docs = [asdict(d) for d in world.documents] if world else list(read_corpus(args.corpus))
    backend = LocalSearchBackend.from_docs(docs, snippet_chars=cfg.snippet_chars)
    llm = None
    if cfg.backend == "llm":
        from megatron_search.data.llm_client import LLMClient

        llm = LLMClient.from_config(load_from_args(args).data.llm)
    pipe = SynthPipeline(cfg, backend, args.work, world=world, progress=_progress(), llm=llm)
    records = pipe.run()
    n = write_jsonl(args.out, records)
    stages = {k: (v["kept"], v["dropped"]) for k, v in pipe.manifest["stages"].items()}
    print(f"synth: {n} QA records -> {args.out}; kept/dropped per stage: {stages}")
    return 0


@_clean_errors
def run_sft(args) -> int:
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.records import read_records
    from megatron_search.data.sft import SFTBuilder
    from megatron_search.data.world import World
    from megatron_search.search.local import LocalSearchBackend
    from megatron_search.search.tool import SearchTool

    cfg = load_from_args(args)
    world = World.load(args.world)
    backend = LocalSearchBackend.from_docs([asdict(d) for d in world.documents], snippet_chars=cfg.search.snippet_chars)
    tool = SearchTool(backend, cfg.search.max_results, cfg.search.max_query_chars, cfg.search.max_calls)
    records = list(read_records(args.qa))
    builder = SFTBuilder(tool, world, cfg.data.sft.seed)
    n_instr = cfg.data.sft.instruction_examples if args.instruction is None else args.instruction
    n_abst = cfg.data.sft.abstention_examples if args.abstention is None else args.abstention
    examples = builder.build(records, n_instr, n_abst, progress=_progress())
    n = write_jsonl(args.out, examples)
    print(f"sft: {n} examples -> {args.out} ({len(builder.dropped)} trajectories dropped)")
    return 0


@_clean_errors
def run_mix(args) -> int:
    from megatron_search.data.jsonl import atomic_write_json, write_jsonl
    from megatron_search.data.mix import MixSampler, qa_item, rubric_item
    from megatron_search.data.records import read_records

    cfg = load_from_args(args).data
    qa = [qa_item(r) for p in args.qa for r in read_records(p)]
    rubric = [rubric_item(row) for p in args.rubric for _, row in _rows(p)]
    datasets = {"qa": qa, "rubric": rubric}
    weights = {k: v for k, v in cfg.mix.items() if datasets.get(k) or v > 0}
    if not rubric and weights.get("rubric", 0) > 0:
        print("mix: no rubric data given; drawing QA only", file=sys.stderr)
        weights["rubric"] = 0.0
    sampler = MixSampler(datasets, weights, cfg.seed)
    if args.state and Path(args.state).exists():
        sampler.load_state_dict(json.loads(Path(args.state).read_text()))
    items = sampler.take(args.num)
    write_jsonl(args.out, items)
    if args.state:
        atomic_write_json(args.state, sampler.state_dict())
    counts = {k: sum(1 for it in items if it.dataset == k) for k in datasets}
    print(f"mix: {len(items)} prompts -> {args.out} {counts}; sampler at step {sampler.step}")
    return 0


def _rows(path: str):
    """(file:line, row) of every row of a file or folder read through `datasets`; a bad row is a DataError."""
    from megatron_search.data.hf_datasets import iter_rows
    from megatron_search.data.jsonl import DataError

    for row in iter_rows(path):
        if row.error:
            raise DataError(f"{row.where}: {row.error}")
        yield row.where, row.data


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for it in items:
        if "=" not in it:
            raise SystemExit(f"data convert: expected SOURCE=PATH, got {it!r}")
        src, path = it.split("=", 1)
        out.append((src.strip().lower(), path))
    return out


@_clean_errors
def run_convert(args) -> int:
    from megatron_search.data.jsonl import SkipCounter, write_jsonl
    from megatron_search.data.prompts import load_keyed
    from megatron_search.data.public import FilterReport, format_augment, iter_convert, match_scale, quality_filter
    from megatron_search.data.records import read_records

    cfg = load_from_args(args).data.convert
    skips = SkipCounter()
    train = [r for src, p in _pairs(args.input)
             for r in iter_convert(src, p, cfg.on_error, skips, _progress(), args.split, args.streaming)]
    evals = [r for src, p in _pairs(args.eval)
             for r in iter_convert(src, p, cfg.on_error, skips, _progress(), args.eval_split, args.streaming)]
    report = FilterReport()
    kept = quality_filter(train, evals, cfg.max_answer_chars, report)
    kept = format_augment(kept, load_keyed(cfg.format_prompts), cfg.augment_fraction, cfg.seed)
    write_jsonl(args.out, kept)
    if args.eval_out:
        write_jsonl(args.eval_out, evals)
    print(f"convert: {len(kept)} training records ({report.kept} questions) -> {args.out}; dropped {report.dropped}; "
          f"bad rows skipped: {skips.skipped}")
    for reason in skips.reasons:
        print(f"  skipped {reason}", file=sys.stderr)
    if args.synthetic:
        if not args.synthetic_out:
            raise SystemExit("data convert: --synthetic needs --synthetic-out")
        syn = list(read_records(args.synthetic, streaming=args.streaming))
        sample = match_scale(syn, len(kept), cfg.seed)
        write_jsonl(args.synthetic_out, sample)
        print(f"convert: {len(sample)} synthetic records (scale-matched) -> {args.synthetic_out}")
    return 0


@_clean_errors
def run_rubrics(args) -> int:
    import asyncio

    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.llm_client import LLMClient
    from megatron_search.data.rubrics import RubricPipeline, item_from_row

    full = load_from_args(args)
    cfg = full.data
    if args.demo is not None:
        from megatron_search.data.rubric_demo import demo_rubric_rows
        from megatron_search.data.world import World

        if not args.world:
            raise SystemExit("data rubrics: --demo needs --world DIR (entity names come from the world)")
        items = [item_from_row(row, f"demo:{i}") for i, row in enumerate(demo_rubric_rows(World.load(args.world), args.demo,
                                                                                           cfg.seed), 1)]
    else:
        items = [item_from_row(row, where) for where, row in _rows(args.input)]
    rc = cfg.rubric

    async def go():
        llm = LLMClient.from_config(cfg.llm)
        policy = llm
        if rc.policy_base_url:
            policy = LLMClient(rc.policy_base_url, rc.policy_model or cfg.llm.model, cfg.llm.api_key_env,
                               cfg.llm.concurrency, cfg.llm.timeout_s, cfg.llm.retries, cfg.llm.backoff_s, cfg.llm.cache_dir)
        # the calibration's judge is GRPO's (reward.rubric_judge) when one is configured, else data.llm
        judge = LLMClient.from_config(full.reward.rubric_judge) if full.reward.rubric_judge else llm
        try:
            pipe = RubricPipeline(llm, judge, policy, rc.samples, rc.sample_temperature, rc.max_tokens,
                                  rc.prompt_version, rc.max_rubric_chars)
            return await pipe.run(items, progress=_progress(), calibrate=not args.no_calibration)
        finally:
            await llm.close()
            await policy.close()
            if judge is not llm:
                await judge.close()

    kept, dropped = asyncio.run(go())
    write_jsonl(args.out, (dict(it.to_dict(), calibrated=not args.no_calibration) for it in kept))
    if args.dropped:
        write_jsonl(args.dropped, (vars(d) for d in dropped))
    reasons: dict[str, int] = {}
    for d in dropped:
        reasons[d.stage] = reasons.get(d.stage, 0) + 1
    print(f"rubrics: {len(kept)} prompts kept -> {args.out}; dropped by stage {reasons}")
    return 0
