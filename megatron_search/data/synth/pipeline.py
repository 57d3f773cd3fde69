"""The resumable synthetic-QA pipeline: runs the stages in order, writing each stage's kept and
dropped records to a work directory. A finished stage is loaded instead of recomputed; verification
(the slow stage) also checkpoints per question, so an interrupted run resumes where it stopped.
The manifest stores a fingerprint of the config: resuming with a different config is an error.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from ...config.data import SynthConfig
from ..jsonl import DataError, atomic_write_json, read_jsonl, write_jsonl
from ..prompts import load_keyed
from ..records import QARecord
from ..world import World
from .augment import to_records
from .evidence import Evidence
from .extract import extract_claims
from .llm_steps import LLMExtractor, SyncRunner, llm_question, llm_solve
from .question import parse
from .solver import DEFAULT_SOLVERS, SolverSpec
from .stages import (CardBook, ChainRecord, Dropped, EntityCard, QuestionRecord, SeedHit, VerifiedRecord,
                     chain_stage, confirm_stage, llm_question_stage, make_seed_queries, make_solver, question_stage,
                     seed_stage, verify_one)
from .truth import world_answers


def _specs(names: list[str]) -> tuple[SolverSpec, ...]:
    known = {s.name: s for s in DEFAULT_SOLVERS}
    missing = [n for n in names if n not in known]
    if missing:
        raise DataError(f"data.synth.solvers: unknown solver(s) {missing}; known: {sorted(known)}")
    return tuple(known[n] for n in names)


class SynthPipeline:
    def __init__(self, cfg: SynthConfig, search: Any, work_dir: str | Path, world: Optional[World] = None,
                 progress: bool = False, llm: Any = None):
        self.cfg = cfg
        self.search = search
        self.work = Path(work_dir)
        self.world = world
        self.progress = progress
        self.llm = llm
        self.runner = None
        extractor = extract_claims
        if cfg.backend == "llm":
            if llm is None:
                raise DataError("data.synth.backend=llm needs an LLM client (data.llm)")
            self.runner = SyncRunner()
            self.extractor = LLMExtractor(llm, self.runner, cfg.prompt_version)
            extractor = self.extractor
            self.specs = tuple(SolverSpec(f"llm-{i}", "llm") for i in range(cfg.llm_solvers))
        else:
            self.specs = _specs(cfg.solvers)
        self.ev = Evidence(search, cfg.search_k, extractor=extractor)
        self.book = CardBook(self.ev, cfg.min_support)
        self.work.mkdir(parents=True, exist_ok=True)
        self._manifest_path = self.work / "manifest.json"
        fp = hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
        if self._manifest_path.exists():
            self.manifest = json.loads(self._manifest_path.read_text())
            if self.manifest.get("fingerprint") != fp:
                raise DataError(f"{self.work} holds a run with a different data.synth config; use a new work dir")
        else:
            self.manifest = {"fingerprint": fp, "stages": {}}

    # -- stage bookkeeping
    def _done(self, stage: str) -> bool:
        return stage in self.manifest["stages"]

    def _save(self, stage: str, kept: list, dropped: list[Dropped]) -> None:
        write_jsonl(self.work / f"{stage}.jsonl", (k.to_dict() if hasattr(k, "to_dict") else asdict(k) for k in kept))
        write_jsonl(self.work / f"{stage}.dropped.jsonl", (asdict(d) for d in dropped))
        reasons: dict[str, int] = {}
        for d in dropped:
            key = d.reason.split(":")[0].split("(")[0].strip()
            reasons[key] = reasons.get(key, 0) + 1
        self.manifest["stages"][stage] = {"kept": len(kept), "dropped": len(dropped), "dropped_by_reason": reasons}
        atomic_write_json(self._manifest_path, self.manifest)

    def _load(self, stage: str) -> list[dict]:
        return list(read_jsonl(self.work / f"{stage}.jsonl"))

    # -- stages
    def run(self) -> list[QARecord]:
        c = self.cfg
        if self._done("seed"):
            hits = [SeedHit(**d) for d in self._load("seed")]
        else:
            hits = seed_stage(make_seed_queries(c.num_seed_queries, c.seed), self.ev, self.progress)
            self._save("seed", hits, [])
        if self._done("confirm"):
            cards = [EntityCard(**d) for d in self._load("confirm")]
        else:
            cards, dropped = confirm_stage(hits, self.book, self.progress)
            self._save("confirm", cards, dropped)
        if self._done("chain"):
            chains = [ChainRecord(**d) for d in self._load("chain")]
        else:
            chains, dropped = chain_stage(cards, self.book, (c.min_hops, c.max_hops), c.seed, c.chains_per_entity, self.progress)
            self._save("chain", chains, dropped)
        if self._done("question"):
            questions = [QuestionRecord.from_dict(d) for d in self._load("question")]
        else:
            if self.runner is not None:
                questions, dropped = llm_question_stage(chains, lambda ch: self.runner.run(llm_question(
                    self.llm, ch.answer_type, ch.claims(), ch.entities, c.prompt_version)))
            else:
                questions, dropped = question_stage(chains)
            self._save("question", questions, dropped)
        if self._done("verify"):
            verified = [VerifiedRecord.from_dict(d) for d in self._load("verify")]
        else:
            verified, dropped = self._verify(questions)
            self._save("verify", verified, dropped)
        if self.world is not None and c.world_truth_check and c.backend == "offline":
            if self._done("truth"):
                verified = [VerifiedRecord.from_dict(d) for d in self._load("truth")]
            else:
                verified, dropped = self._truth(verified)
                self._save("truth", verified, dropped)
        if self.runner is not None:
            self.runner.run(self.llm.close())  # the client's HTTP session lives on the runner's loop
            self.runner.close()
            self.runner = None
        records = to_records(verified, load_keyed(c.format_prompts), c.augment_fraction, c.validation_fraction, c.seed)
        self.manifest["records"] = len(records)
        atomic_write_json(self._manifest_path, self.manifest)
        return records

    def _verify(self, questions: list[QuestionRecord]) -> tuple[list[VerifiedRecord], list[Dropped]]:
        """Per-question checkpoint in verify.partial.jsonl (append-only; a torn last line is ignored)."""
        partial = self.work / "verify.partial.jsonl"
        done: dict[str, dict] = {}
        if partial.exists():
            for line in partial.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    done[row["id"]] = row
                except (ValueError, KeyError):
                    continue
            # drop a torn last line before appending after it
            write_jsonl(partial, done.values())
        if self.runner is not None:
            index = {s.name: i for i, s in enumerate(self.specs)}

            def solver(question, spec):
                return self.runner.run(llm_solve(self.llm, question, self.search, spec.name, self.cfg.llm_solver_max_calls,
                                                 self.cfg.search_k, self.cfg.llm_solver_temperature, index[spec.name],
                                                 self.cfg.prompt_version))
        else:
            solver = make_solver(self.search)
        with open(partial, "a", encoding="utf-8") as f:
            for q in tqdm(questions, desc="synth: verify", disable=not self.progress):
                if q.chain.id in done:
                    continue
                out = verify_one(q, solver, self.specs, self.cfg.quorum)
                row = {"id": q.chain.id, "kept": isinstance(out, VerifiedRecord),
                       "record": out.to_dict() if isinstance(out, VerifiedRecord) else asdict(out)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[q.chain.id] = row
        kept, dropped = [], []
        for q in questions:
            row = done[q.chain.id]
            if row["kept"]:
                kept.append(VerifiedRecord.from_dict(row["record"]))
            else:
                dropped.append(Dropped(**row["record"]))
        return kept, dropped

    def _truth(self, verified: list[VerifiedRecord]) -> tuple[list[VerifiedRecord], list[Dropped]]:
        kept, dropped = [], []
        for v in verified:
            (plan,) = parse(v.question)
            answers = world_answers(self.world, plan)
            if answers == {v.chain.answer}:
                kept.append(v)
            else:
                dropped.append(Dropped("truth", v.to_dict(), f"ground truth has {len(answers)} answer(s): {sorted(answers)[:3]}"))
        return kept, dropped
