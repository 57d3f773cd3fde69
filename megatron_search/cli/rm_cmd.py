"""`megatron-search rm train|score|eval|convert`: the preference reward model (RECIPE 5.1).

    megatron-search rm train [config] [key=value ...] [--demo N]   # BT training, checkpoints, TensorBoard
    megatron-search rm score [config] rm.load=CKPT --pairs P.jsonl --out S.jsonl [--vote-name NAME]
    megatron-search rm eval  [config] rm.load=CKPT --pairs P.jsonl          # held-out accuracy / margin
    megatron-search rm eval  [config] rm.load=CKPT --sbs S.jsonl            # sbs: {context, candidate, baseline}
    megatron-search rm convert --input X.jsonl --out P.jsonl --source NAME  # chosen/rejected -> pairs

`--demo N` writes the synthetic cite-the-source preference set (N pairs, 25% held out) under
run.output_dir and trains on it; when model.tokenizer does not fit the tiny model, a BPE is
trained on the demo texts first. Runs in one process or under torchrun (the model's TP/PP/EP).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rm", help="preference reward model: train, score, eval, convert")
    rsub = p.add_subparsers(dest="rm_command", metavar="ACTION")
    rsub.required = True

    t = rsub.add_parser("train", help="train the reward model (symmetric Bradley-Terry loss)")
    add_config_args(t)
    t.add_argument("--demo", type=int, default=None, metavar="N", help="train on N synthetic cite-rule pairs")
    t.set_defaults(func=run_train)

    s = rsub.add_parser("score", help="P_bar(answer_a beats answer_b) for every pair of a JSONL file")
    add_config_args(s)
    s.add_argument("--pairs", required=True)
    s.add_argument("--out", required=True, help="JSONL: the pairs with p_bar (and a vote with --vote-name)")
    s.add_argument("--vote-name", default=None, help="record the RM's vote under this name (noise filter input)")
    s.set_defaults(func=run_score)

    e = rsub.add_parser("eval", help="held-out accuracy / margin, or the sbs metric")
    add_config_args(e)
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--pairs", help="labelled pairs JSONL")
    g.add_argument("--sbs", help="JSONL of {context, candidate, baseline}")
    e.set_defaults(func=run_eval)

    c = rsub.add_parser("convert", help="chosen/rejected records -> preference pairs JSONL")
    c.add_argument("--input", required=True,
                   help="JSONL / parquet / Arrow file, or a folder in the Hub's layout or saved with save_to_disk")
    c.add_argument("--split", default=None, help="the folder's split to read (default: its only split)")
    c.add_argument("--out", required=True)
    c.add_argument("--source", required=True, help="source name stored with every pair")
    c.add_argument("--skip-bad", action="store_true", help="skip and count bad records instead of failing")
    c.add_argument("--seed", type=int, default=0, help="seed of the presentation order")
    c.set_defaults(func=run_convert)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _init(cfg, stage: str | None = None):
    from megatron_search.distributed import init_distributed

    return init_distributed(cfg, stage=stage)


def _read(path: str, cfg, what: str):
    from megatron_search.rm.data import ReadStats, read_pairs

    stats = ReadStats()
    pairs = read_pairs(path, on_bad=cfg.rm.on_bad_pair, stats=stats)
    print(f"{what} {path}: {stats.summary()}")
    return pairs


def _demo_data(cfg, n: int):
    """Write the synthetic set (and, if needed, a tokenizer) under run.output_dir; returns overrides."""
    from megatron_search.rm.data import write_pairs
    from megatron_search.rm.synthetic import split_pairs, synthetic_pairs
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer, load_tokenizer

    out = Path(cfg.run.output_dir) / "rm_demo"
    pairs = synthetic_pairs(n, seed=cfg.rm.seed)
    train, held = split_pairs(pairs, 0.25, seed=cfg.rm.seed)
    write_pairs(out / "train.jsonl", train)
    write_pairs(out / "eval.jsonl", held)
    overrides = {"rm.train_data": str(out / "train.jsonl"), "rm.eval_data": str(out / "eval.jsonl")}
    try:
        fits = load_tokenizer(cfg.model.tokenizer).vocab_size <= cfg.model.architecture.vocab_size
    except (OSError, ValueError, KeyError):
        fits = False
    if not fits:
        fmt = ChatFormat(cfg.model.chat_style)
        texts = [fmt.render(p.messages + [{"role": "assistant", "content": y}]) for p in pairs
                 for y in (p.answer_a, p.answer_b)]
        tok = BPETokenizer.train(texts, vocab_size=min(1024, cfg.model.architecture.vocab_size))
        overrides["model.tokenizer"] = str(tok.save(out / "tokenizer"))
        print(f"demo: trained a {tok.vocab_size}-id BPE for the tiny model -> {overrides['model.tokenizer']}")
    print(f"demo: {len(train)} training / {len(held)} held-out pairs under {out}")
    return overrides


def run_train(args: argparse.Namespace) -> int:
    from megatron_search.rm.data import PreferenceDataError, ReadStats, filter_by_agreement

    cfg = load_from_args(args, stage="rm")
    try:
        if args.demo is not None:
            args.overrides = list(args.overrides) + [f"{k}={v}" for k, v in _demo_data(cfg, args.demo).items()]
            cfg = load_from_args(args, stage="rm")
        if not cfg.rm.train_data:
            return _fail("rm.train_data: no training pairs given (or use --demo N)")
        train = _read(cfg.rm.train_data, cfg, "train")
        held = _read(cfg.rm.eval_data, cfg, "eval") if cfg.rm.eval_data else []
        if cfg.rm.noise_filter:
            stats = ReadStats()
            train = filter_by_agreement(train, cfg.rm.agreement_threshold, cfg.rm.min_scoring_models, stats)
            print(f"noise filter: {stats.summary()}")
    except (OSError, PreferenceDataError, ValueError) as e:
        return _fail(str(e))

    from megatron_search.rm.build import load_encoder
    from megatron_search.rm.train import RMTrainer, train_rm

    ctx = _init(cfg, stage="rm")
    try:
        encoder, pad_id = load_encoder(cfg)
        trainer = RMTrainer(cfg, ctx)
        result = train_rm(trainer, train, held, encoder, pad_id)
    except ValueError as e:
        return _fail(str(e))
    finally:
        ctx.teardown()
    if ctx.is_main:
        print(json.dumps(result, indent=1, default=str))
    return 0


def _scorer(cfg, ctx):
    from megatron_search.rm.build import build_scorer

    return build_scorer(cfg, ctx.groups)


def run_score(args: argparse.Namespace) -> int:
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.rm.data import PreferenceDataError, with_votes

    cfg = load_from_args(args)
    try:
        pairs = _read(args.pairs, cfg, "pairs")
    except (OSError, PreferenceDataError) as e:
        return _fail(str(e))
    ctx = _init(cfg)
    try:
        p = _scorer(cfg, ctx).p_bar([x.messages for x in pairs], [x.answer_a for x in pairs], [x.answer_b for x in pairs])
    except (OSError, ValueError) as e:
        return _fail(str(e))
    finally:
        ctx.teardown()
    if args.vote_name:
        pairs = with_votes(pairs, args.vote_name, p.tolist())
    if ctx.is_main:
        n = write_jsonl(args.out, ({**x.to_json(), "p_bar": float(s)} for x, s in zip(pairs, p)))
        print(f"scored {n} pairs -> {args.out}")
    return 0


def _read_sbs(path: str):
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ctx = d["context"]
                ctx = [{"role": "user", "content": ctx}] if isinstance(ctx, str) else ctx
                rows.append((ctx, str(d["candidate"]), str(d["baseline"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: needs context, candidate and baseline ({e})") from None
    return rows


def run_eval(args: argparse.Namespace) -> int:
    from megatron_search.rm.data import PreferenceDataError
    from megatron_search.rm.sbs import evaluate_pairs, sbs

    cfg = load_from_args(args)
    try:
        data = _read(args.pairs, cfg, "pairs") if args.pairs else _read_sbs(args.sbs)
    except (OSError, PreferenceDataError, ValueError) as e:
        return _fail(str(e))
    ctx = _init(cfg)
    try:
        scorer = _scorer(cfg, ctx)
        if args.pairs:
            result = evaluate_pairs(scorer, data)
        else:
            result = sbs(scorer, [r[0] for r in data], [r[1] for r in data], [r[2] for r in data])
    except (OSError, ValueError) as e:
        return _fail(str(e))
    finally:
        ctx.teardown()
    if ctx.is_main:
        print(json.dumps(result, indent=1))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from megatron_search.data.jsonl import DataError
    from megatron_search.rm.data import PreferenceDataError, ReadStats, convert_file, write_pairs

    stats = ReadStats()
    try:
        pairs = convert_file(args.input, args.source, on_bad="skip" if args.skip_bad else "error", seed=args.seed,
                             stats=stats, split=args.split)
    except (OSError, PreferenceDataError, DataError) as e:  # DataError: a path that is no local file or folder
        return _fail(str(e))
    write_pairs(args.out, pairs)
    print(f"{args.input}: {stats.summary()} -> {args.out}")
    return 0
