"""The embedded demo: the whole recipe end to end on one CPU machine, with no downloads.

    world -> search index -> single-hop QA + SFT trajectories (+ practice worlds') + copy/reading
      drills -> tokenizer -> copy warm-up (sft on the copy drills) -> reading warm-up (optional)
      -> agent SFT (sft, from the last warm-up's weights)
      -> reward model (rm train) -> GRPO (grpo) -> held-out eval

Stages run as `megatron-search` subcommands in fresh processes (exactly what a user would type,
and Megatron's global state never leaks between stages). Each stage leaves its output under
--out and is skipped when that output exists, so an interrupted demo continues where it stopped.
The report (report.md / report.json) compares the SFT policy (GRPO's initial weights) with the
GRPO policy on held-out questions: accuracy, tool calls, tokens; plus GRPO's reward curve.

The demo's questions are single-hop (data/demo_tasks.py says why); the multi-hop pipeline of
RECIPE 4.1 runs with `megatron-search data synth`. The copy warm-up stands in for the pretraining a
real policy starts from: a model trained from scratch must first learn to copy a name out of its
context (the `demo` config section sizes it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import BPETokenizer
from megatron_search.config import load_config
from megatron_search.data.demo_tasks import (EPISODE_STRATEGIES, QUERY_FOR_LAYOUT, copy_drills, names_by_type,
                                             one_hop_records, one_hop_sft_examples, practice_trajectories,
                                             reading_drills, short_trajectories, split_for_rl)
from megatron_search.data.jsonl import read_jsonl, write_jsonl
from megatron_search.data.world import build_world, word_pool
from megatron_search.eval import BenchmarkSpec, evaluate
from megatron_search.eval.metrics import broken_tool_calls, paired_accuracy_difference
from megatron_search.eval.results import ResultStore
from megatron_search.search.local import build_index
from megatron_search.search.tool import SearchTool

from .report import FIGURES, pass_at_k, plot_curves, strategy_table

DEMO_CONFIG = "configs/demo.yaml"


def _cli(args: list[str], log: Path) -> None:
    """Run a megatron-search subcommand; its output goes to the console as is (progress bars
    included) and to the demo log."""
    cmd = [sys.executable, "-m", "megatron_search.cli", *args]
    with log.open("ab") as f:
        f.write(("$ megatron-search " + " ".join(args) + "\n").encode())
        f.flush()
        # Library import-time warnings (Megatron without TE/Apex, ...) would bury the progress lines.
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        while chunk := proc.stdout.read1(65536):
            f.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        if proc.wait() != 0:
            raise RuntimeError(f"`megatron-search {args[0]}` failed (exit {proc.returncode}); log: {log}")


class Demo:
    def __init__(self, out: Path, config: str, overrides: list[str]):
        self.out = out
        self.config = config
        self.overrides = overrides
        self.log = out / "demo.log"
        self.times: dict[str, float] = {}
        self.curriculum = load_config(config, overrides).demo  # the `demo` section

    def paths(self) -> dict[str, Path]:
        o = self.out
        return {"world": o / "world", "index": o / "index", "qa": o / "qa.jsonl", "grpo_qa": o / "grpo_qa.jsonl", "tokenizer": o / "tokenizer.json",
                "sft_tool": o / "sft_tool.jsonl", "sft_practice": o / "sft_practice.jsonl",
                "sft_copy": o / "sft_copy.jsonl", "sft_copy_varied": o / "sft_copy_varied.jsonl",
                "sft_read": o / "sft_read.jsonl", "sft_short": o / "sft_short.jsonl", "copy_check": o / "copy_check.jsonl",
                "read_check": o / "read_check.jsonl", "short_check": o / "short_check.jsonl",
                "warmup": o / "warmup", "reading_warmup": o / "reading_warmup",
                "sft": o / "sft", "rm": o / "rm", "grpo": o / "grpo", "eval": o / "eval", "eval_train": o / "eval_train"}

    def common(self) -> list[str]:
        p = self.paths()
        return [f"model.tokenizer={p['tokenizer']}", f"search.index_dir={p['index']}", *self.overrides]

    def _mix(self, weights: dict[str, float]) -> str:
        """`sft.datasets` override for a {part: weight} mix of the demo's SFT files (config.demo.PARTS)."""
        p = self.paths()
        files = {"tool": p["sft_tool"], "practice": p["sft_practice"], "copy": p["sft_copy"],
                 "copy_varied": p["sft_copy_varied"], "read": p["sft_read"], "short": p["sft_short"]}
        return "{" + ", ".join(f"{files[k]}: {w}" for k, w in weights.items() if w > 0) + "}"

    def stage(self, name: str, done: Path, fn) -> None:
        if done.exists():
            print(f"[demo] {name}: done before ({done})", flush=True)
            return
        print(f"[demo] {name} ...", flush=True)
        t0 = time.perf_counter()
        fn()
        self.times[name] = time.perf_counter() - t0
        print(f"[demo] {name}: {self.times[name]:.0f}s", flush=True)

    # ------------------------------------------------------------------ stages
    def build_data(self) -> None:
        p = self.paths()
        cfg = load_config(self.config, self.overrides)
        cur = cfg.demo
        words = word_pool(cfg.run.seed, cur.name_words) if cur.name_words else None
        world = build_world(seed=cfg.run.seed, phrasing=cur.world_phrasing, words=words, layout=cur.world_layout)
        world.save(p["world"])
        docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
        build_index(docs, p["index"], progress=False)
        records = one_hop_records(world, seed=cfg.run.seed, query=QUERY_FOR_LAYOUT[cur.world_layout])
        tool = SearchTool.from_config(cfg.search.model_copy(update={"index_dir": str(p["index"])}))
        sft_records, rl_records = split_for_rl(records, cfg.run.seed, cur.rl_questions)
        examples, dropped = one_hop_sft_examples(sft_records, tool, cur.answer_style,
                                                 strategies=cur.strategy_mix, pool=names_by_type(world),
                                                 seed=cfg.run.seed)
        practice, clashes = practice_trajectories(world, cur.practice_worlds, cfg.run.seed, cfg.search,
                                                  cur.answer_style, cur.world_phrasing, strategies=cur.strategy_mix,
                                                  words=words, layout=cur.world_layout)
        copies = copy_drills(world, cur.copy_drills, seed=cfg.run.seed, words=words)
        varied = copy_drills(world, cur.copy_drills, seed=cfg.run.seed + 1, layout="varied", words=words)
        reads = reading_drills(world, cur.reading_drills, seed=cfg.run.seed, answer=cur.answer_style,
                               phrasing=cur.world_phrasing, words=words)
        # held-out drills for the warm-ups' skill checks: names drawn with seeds no training drill uses
        copy_check = copy_drills(world, cur.skill_check_drills, seed=cfg.run.seed + 1_000_003, words=words)
        read_check = reading_drills(world, cur.skill_check_drills, seed=cfg.run.seed + 1_000_003,
                                    answer=cur.answer_style, phrasing=cur.world_phrasing, words=words)
        def one_search(num_worlds: int, seed: int) -> list:
            """Short one-search trajectories over `num_worlds` fresh worlds (short_trajectories)."""
            found, _ = practice_trajectories(world, num_worlds, seed, cfg.search, cur.answer_style, cur.world_phrasing,
                                             words=words, layout=cur.world_layout)
            return short_trajectories(found)

        shorts = one_search(cur.reading_worlds, cfg.run.seed + 2_000_003)  # the reading warm-up's own worlds
        # a world no training trajectory comes from: its short trajectories check the "short" warm-up
        short_check = one_search(1, cfg.run.seed + 1_000_003)[:cur.skill_check_drills]
        fmt = ChatFormat(style=cfg.model.chat_style)
        # the tokenizer sees a sample of the practice trajectories: their text repeats the tool schema and templates
        sample = examples + practice[:cur.tokenizer_practice_sample] + copies + varied + reads
        texts = [d["text"] for d in docs] + [fmt.render(e.messages, e.tools or None) for e in sample]
        vocab = cfg.model.architecture.vocab_size
        tok = BPETokenizer.train(texts, vocab_size=vocab, words=words or ())
        if tok.vocab_size != vocab:  # the policy samples any of its ids: each must decode
            raise RuntimeError(f"the demo BPE has {tok.vocab_size} ids but the model {vocab} embeddings: the texts are too "
                               "few to learn that many merges (raise demo.copy_drills / demo.reading_drills)")
        tok.save(p["tokenizer"])
        write_jsonl(p["sft_tool"], [e.to_dict() for e in examples])
        write_jsonl(p["sft_practice"], [e.to_dict() for e in practice])
        write_jsonl(p["sft_copy"], [e.to_dict() for e in copies])
        write_jsonl(p["sft_copy_varied"], [e.to_dict() for e in varied])
        write_jsonl(p["sft_read"], [e.to_dict() for e in reads])
        write_jsonl(p["copy_check"], [e.to_dict() for e in copy_check])
        write_jsonl(p["read_check"], [e.to_dict() for e in read_check])
        write_jsonl(p["sft_short"], [e.to_dict() for e in shorts])
        write_jsonl(p["short_check"], [e.to_dict() for e in short_check])
        if cur.rl_questions:
            write_jsonl(p["grpo_qa"], [r.to_dict() for r in rl_records])
        write_jsonl(p["qa"], [r.to_dict() for r in records])  # last: its existence marks the stage done
        n_test = sum(r.split == "test" for r in records)
        shares = Counter(e.metadata["strategy"] for e in examples + practice)
        total = max(1, sum(shares.values()))
        print(f"   world: {len(world.entities)} entities, {len(docs)} documents; {len(records)} questions "
              f"({n_test} held out, {len(rl_records)} kept for GRPO); {len(examples)} tool trajectories ({len(dropped)} dropped: search missed "
              f"the answer), {len(practice)} practice trajectories from {cur.practice_worlds} extra worlds ({clashes} "
              f"dropped: they name a demo entity), {len(copies)} + {len(varied)} copy and {len(reads)} reading drills, "
              f"{len(shorts)} short trajectories from {cur.reading_worlds} reading worlds; "
              "strategies: " + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(shares.items())), flush=True)

    def warmup(self) -> None:
        """Copy warm-up: SFT on the copy drills alone, one short drill per row (no packing, so each
        row holds exactly one name to copy), large batches, constant LR."""
        p, d = self.paths(), self.curriculum
        _cli(["sft", self.config, *self.common(), f"run.output_dir={p['warmup']}", f"sft.datasets={{{p['sft_copy']}: 1.0}}",
              f"sft.steps={d.warmup_steps}", f"optim.lr={d.warmup_lr}", "optim.lr_schedule=constant",
              "sft.packing=false", f"sft.seq_length={d.warmup_seq_length}", f"sft.global_batch_size={d.warmup_batch}",
              f"sft.micro_batch_size={d.warmup_batch}", f"checkpoint.save_interval={d.warmup_steps}",
              *self._skill_check(p["copy_check"], d.warmup_threshold)], self.log)

    def _skill_check(self, path: Path, threshold: float) -> list[str]:
        """sft.skill_check overrides: the warm-up ends once `threshold` of the held-out drills at `path` are
        answered exactly (its step count is the cap)."""
        d = self.curriculum
        return [f"sft.skill_check.path={path}", f"sft.skill_check.threshold={threshold}",
                f"sft.skill_check.every={d.skill_check_every}", f"sft.skill_check.max_examples={d.skill_check_drills}"]

    def reading_warmup(self) -> None:
        """Reading warm-up, from the copy warm-up's weights: copy drills with the name anywhere and
        reading drills, small batches for many steps (the skill appears late and abruptly: 0% of
        reading drills after 800 steps, 45% after 1,600, measured)."""
        p, d = self.paths(), self.curriculum
        _cli(["sft", self.config, *self.common(), f"run.output_dir={p['reading_warmup']}",
              f"sft.datasets={self._mix(d.reading_warmup_mix)}",
              *([f"checkpoint.load={p['warmup'] / 'checkpoints'}"] if d.warmup_steps else []),
              f"sft.steps={d.reading_warmup_steps}", f"optim.lr={d.reading_warmup_lr}", "optim.lr_schedule=constant",
              "sft.packing=false", f"sft.seq_length={d.reading_warmup_seq_length}",
              f"sft.global_batch_size={d.reading_warmup_batch}", f"sft.micro_batch_size={d.reading_warmup_batch}",
              f"checkpoint.save_interval={d.reading_warmup_steps}",
              *self._skill_check(self._reading_check(), d.reading_threshold)], self.log)

    def _reading_check(self) -> Path:
        """The reading warm-up's held-out check: short trajectories of an unseen practice world when it trains on
        short trajectories (the answer copied out of the real results), else the reading drills."""
        p = self.paths()
        return p["short_check"] if self.curriculum.reading_warmup_mix.get("short") else p["read_check"]

    def _start(self) -> list[str]:
        """`checkpoint.load` of the latest warm-up stage that ran (none: from scratch)."""
        p, d = self.paths(), self.curriculum
        stage = "reading_warmup" if d.reading_warmup_steps else "warmup" if d.warmup_steps else None
        return [f"checkpoint.load={p[stage] / 'checkpoints'}"] if stage else []

    def sft(self) -> None:
        p, d = self.paths(), self.curriculum
        load = self._start()
        start = [*load, f"optim.lr={d.sft_lr}", f"optim.min_lr={d.sft_min_lr}"] if load else []
        _cli(["sft", self.config, *self.common(), f"run.output_dir={p['sft']}", f"sft.datasets={self._mix(d.sft_mix)}",
              *start], self.log)

    def reward_model(self) -> None:
        p = self.paths()
        _cli(["rm", "train", self.config, *self.common(), f"run.output_dir={p['rm']}",
              f"rm.init_from={p['sft'] / 'checkpoints'}", "--demo", "256"], self.log)

    def _rl_qa(self) -> Path:
        """GRPO's questions (split train): those kept out of the SFT (demo.rl_questions), or all training ones."""
        p = self.paths()
        return p["grpo_qa"] if self.curriculum.rl_questions else p["qa"]

    def grpo(self) -> None:
        p = self.paths()
        _cli(["grpo", self.config, *self.common(), f"run.output_dir={p['grpo']}", f"data.qa_path={self._rl_qa()}",
              f"rm.load={p['rm'] / 'checkpoints'}", f"checkpoint.load={p['sft'] / 'checkpoints'}",
              f"optim.lr={self.curriculum.grpo_lr}", "optim.lr_schedule=constant", "optim.warmup_steps=0"], self.log)

    def evaluate(self) -> None:
        p = self.paths()
        cfg = load_config(self.config, self.common())
        models = {"sft": str(p["grpo"] / "reference_weights"), "grpo": str(p["grpo"] / "final_weights")}
        # RECIPE 8's standard protocol: the training prompt (no budget sentence, which the demo's SFT data
        # never shows), at most eval.max_calls calls
        evaluate(cfg, models, [BenchmarkSpec("records", str(p["qa"]), split="test", name="heldout")], p["eval"],
                 index_dir=str(p["index"]), variants=("standard",), progress=True)
        # RL's ceiling: the SFT policy's pass@k on a sample of the training questions (report.pass_at_k)
        d = self.curriculum
        cfg_k = load_config(self.config, [*self.common(), f"eval.samples={d.pass_k}"])
        evaluate(cfg_k, {"sft": models["sft"]}, [BenchmarkSpec("records", str(self._rl_qa()), split="train", name="train")],
                 p["eval_train"], index_dir=str(p["index"]), variants=("standard",), limit=d.pass_k_questions,
                 progress=True, tensorboard=False)

    # ------------------------------------------------------------------ report
    def report(self) -> dict:
        p = self.paths()
        ev = json.loads((p["eval"] / "report.json").read_text())
        tags = {t for _, tags in FIGURES.values() for t in tags}
        series = _series(p["grpo"] / "tensorboard", tags)
        rewards = [v for _, v in series.get("reward/mean", [])]
        r_base = [v for _, v in series.get("reward/r_base", [])]
        episodes = _heldout_episodes(p["eval"] / "results.jsonl")
        subjects = {r["id"]: r["metadata"]["subject"] for r in read_jsonl(p["qa"])}
        train_rows = list(ResultStore(p["eval_train"] / "results.jsonl").rows(model="sft", benchmark="train"))
        figures = plot_curves(series, self.out)
        rep = {"heldout": _model_rows(ev, episodes), "grpo_minus_sft": _paired_difference(episodes),
               "strategies": {m: strategy_table(rows, subjects) for m, rows in episodes.items()},
               "sft_train_pass_at_k": pass_at_k(train_rows),
               "grpo_reward_first": rewards[:1], "grpo_reward_last": rewards[-1:],
               "grpo_r_base_first": r_base[:1], "grpo_r_base_last": r_base[-1:],
               "figures": [f.name for f in figures],
               "warmups": {name: _skill_checks(p[name] / "skill_checks.jsonl", threshold)
                           for name, threshold in (("warmup", self.curriculum.warmup_threshold),
                                                   ("reading_warmup", self.curriculum.reading_threshold))
                           if (p[name] / "skill_checks.jsonl").exists()},
               "stage_seconds": {**_previous_stage_seconds(self.out / "report.json"), **self.times}}
        (self.out / "report.json").write_text(json.dumps(rep, indent=1))
        k = ev["eval_config"]["samples"]
        per = f" (mean of {k} samples per question)" if k > 1 else ""
        lines = ["# megatron-search demo report", ""]
        for name, w in rep["warmups"].items():
            state = (f"reached at step {w['step']}" if w["reached"] else f"NOT reached by step {w['step']} (the cap)")
            lines.append(f"- {name.replace('_', ' ')}: {100 * w['accuracy']:.1f}% of held-out drills answered exactly, "
                         f"threshold {100 * w['threshold']:.0f}% {state}")
        if rep["warmups"]:
            lines.append("")
        lines += [f"| model | held-out accuracy{per} | tool calls / question | effective calls / question | "
                 "episodes with a broken tool call |",
                 "| --- | --- | --- | --- | --- |"]
        for name, row in rep["heldout"].items():
            eff = "-" if row["effective_calls"] is None else f"{row['effective_calls']:.2f}"
            lines.append(f"| {name} | {row['accuracy']:.3f} | {row['tool_calls']:.2f} | {eff} | "
                         f"{row['broken_call_episodes']:.3f} |")
        d = rep["grpo_minus_sft"]
        points = round(100 * d["difference"], 1) + 0.0  # + 0.0: no "-0.0"
        lines += ["", f"GRPO - SFT: {points:+.1f} points, standard error {100 * d['stderr']:.1f} "
                      f"(paired over {d['questions']} held-out questions)"]
        lines += ["", "Strategy of each held-out episode, from its queries (share of episodes, and their accuracy):", "",
                  "| strategy | " + " | ".join(rep["strategies"]) + " |", "| --- |" + " --- |" * len(rep["strategies"])]
        for st in EPISODE_STRATEGIES:
            cells = []
            for table in rep["strategies"].values():
                acc = table[st]["accuracy"]
                cells.append(f"{100 * table[st]['share']:.1f}% ({'-' if acc is None else f'{100 * acc:.0f}% right'})")
            lines.append(f"| {st} | " + " | ".join(cells) + " |")
        pk = rep["sft_train_pass_at_k"]
        if pk["questions"]:
            lines += ["", f"SFT policy on {pk['questions']} of GRPO's training questions: pass@{pk['k']} "
                          f"{100 * pk['pass_at_k']:.1f}%, pass@1 {100 * pk['pass_at_1']:.1f}% (RL's ceiling)"]
        if rewards:
            lines += ["", f"GRPO mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}; "
                          f"QA correctness r_base: {r_base[0]:.3f} -> {r_base[-1]:.3f}"]
        lines += [f"![{f.stem}]({f.name})" for f in figures]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return rep

    def run(self) -> dict:
        p = self.paths()
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.stage("data: world, index, questions, trajectories, tokenizer", p["qa"], self.build_data)
        if self.curriculum.warmup_steps:
            self.stage("copy warm-up", p["warmup"] / "checkpoints" / "latest", self.warmup)
        if self.curriculum.reading_warmup_steps:
            self.stage("reading warm-up", p["reading_warmup"] / "checkpoints" / "latest", self.reading_warmup)
        self.stage("SFT", p["sft"] / "checkpoints" / "latest", self.sft)
        self.stage("reward model", p["rm"] / "checkpoints" / "latest", self.reward_model)
        self.stage("GRPO", p["grpo"] / "final_weights" / "model.safetensors", self.grpo)
        self.stage("held-out evaluation", p["eval"] / "report.json", self.evaluate)
        rep = self.report()
        print(f"[demo] finished in {time.perf_counter() - t0:.0f}s; report: {self.out / 'report.md'}", flush=True)
        return rep


def _skill_checks(log: Path, threshold: float) -> dict:
    """A warm-up's last skill check: {step, accuracy, reached, threshold, checks} (sft.skill_check's log)."""
    rows = list(read_jsonl(log))
    last = rows[-1] if rows else {"iteration": 0, "accuracy": 0.0, "reached": False}
    return {"step": last["iteration"], "accuracy": last["accuracy"], "reached": bool(last["reached"]),
            "threshold": threshold, "checks": [(r["iteration"], r["accuracy"]) for r in rows]}


def _previous_stage_seconds(report: Path) -> dict:
    """Stage times of an earlier (interrupted or finished) run in this directory: kept in the report."""
    try:
        return json.loads(report.read_text()).get("stage_seconds", {})
    except (OSError, ValueError):
        return {}


def _series(logdir: Path, tags) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of GRPO's TensorBoard scalars (tags it never logged are absent)."""
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    have = set(ea.Tags()["scalars"])
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in tags if t in have}


def _heldout_episodes(results: Path) -> dict[str, list[dict]]:
    """{model: its held-out episodes (standard variant)} from the eval's results file."""
    store = ResultStore(results)
    return {m: list(store.rows(model=m, variant="standard", benchmark="heldout")) for m in ("sft", "grpo")}


def _model_rows(ev: dict, episodes: dict[str, list[dict]]) -> dict:
    """{model: {accuracy, tool_calls, effective_calls, broken_call_episodes}} on the held-out set (the eval
    report's standard variant; effective_calls is None in eval reports written before it was measured;
    broken_call_episodes: the fraction of episodes with a malformed or otherwise broken tool call)."""
    out = {}
    for model, d in ev["deployment"].items():
        row = d["standard"]["heldout"]
        out[model] = {"accuracy": row["accuracy"], "tool_calls": row["mean_tool_calls"],
                      "effective_calls": row.get("mean_effective_calls"),
                      "broken_call_episodes": broken_tool_calls(episodes[model])["episodes_with_broken"]}
    return out


def _paired_difference(episodes: dict[str, list[dict]]) -> dict:
    """GRPO's held-out accuracy minus SFT's, paired by question, with its standard error."""
    return paired_accuracy_difference(episodes["grpo"], episodes["sft"])
