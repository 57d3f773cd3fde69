"""`megatron-search demo` end to end with every stage shrunk to a step or two: each stage runs as the
README says (data, copy warm-up, reading warm-up, agent SFT from the warm-ups' weights, reward model,
GRPO, held-out evaluation), a second call skips the finished stages, and the report reads back."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_every_stage_then_resumes(tmp_path, capsys):
    from megatron_search.cli import main

    out = tmp_path / "demo"
    # every optional part on: first-template world, sentence answers, a practice world, the reading warm-up
    overrides = ["demo.copy_drills=3000", "demo.reading_drills=1000", "demo.warmup_steps=2", "demo.warmup_batch=8",
                 "demo.answer_style=sentence", "demo.world_phrasing=first", "demo.practice_worlds=1",
                 "demo.reading_worlds=1",
                 "demo.sft_mix={tool: 0.5, practice: 0.3, read: 0.2}", "demo.reading_warmup_steps=2",
                 "demo.reading_warmup_batch=4", "sft.packing=false", "sft.seq_length=736",
                 "sft.steps=2", "sft.global_batch_size=2", "sft.micro_batch_size=2",
                 "rm.steps=1", "rm.global_batch_pairs=4", "rm.micro_batch_pairs=2",
                 "grpo.steps=1", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=2",
                 "rollout.max_new_tokens=8", "rollout.max_turns=2", "eval.max_new_tokens=8",
                 "demo.pass_k=2", "demo.pass_k_questions=3", "demo.rl_questions=0.5",
                 "checkpoint.save_interval=1000", "logging.progress_bars=false"]
    assert main(["demo", *overrides, "--out", str(out)]) == 0
    first = capsys.readouterr().out
    for stage in ("data", "copy warm-up", "reading warm-up", "SFT", "reward model", "GRPO", "held-out evaluation"):
        assert f"[demo] {stage}" in first
    for stage in ("warmup", "reading_warmup", "sft"):
        assert (out / stage / "checkpoints" / "latest").exists()
    copies = [json.loads(line) for line in (out / "sft_copy.jsonl").open()]
    assert len(copies) == 3000 and copies[0]["messages"][1]["content"] in copies[0]["messages"][0]["content"]
    reads = [json.loads(line) for line in (out / "sft_read.jsonl").open()]
    assert all(r["messages"][1]["content"].endswith(".") and r["metadata"]["answers"][0] in r["messages"][1]["content"]
               for r in reads)
    practice = [json.loads(line) for line in (out / "sft_practice.jsonl").open()]
    assert len(practice) > 100 and all(r["id"].startswith("practice0-") for r in practice)
    # each stage starts from the one before: copy warm-up -> reading warm-up -> agent SFT
    cmds = [line for line in (out / "demo.log").read_text().splitlines() if line.startswith("$ megatron-search sft")]
    assert len(cmds) == 3
    assert "checkpoint.load" not in cmds[0] and f"checkpoint.load={out / 'warmup' / 'checkpoints'}" in cmds[1]
    # the reading warm-up (default mix): one-search trajectories of its own world (demo.reading_worlds), without
    # the system prompt, checked on those of a world it never trains on
    assert "sft_short.jsonl: 1.0" in cmds[1] and f"sft.skill_check.path={out / 'short_check.jsonl'}" in cmds[1]
    shorts = [json.loads(line) for line in (out / "sft_short.jsonl").open()]
    check = [json.loads(line) for line in (out / "short_check.jsonl").open()]
    for rows in (shorts, check):
        assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"] and not r["tools"]
                   and r["metadata"]["strategy"] == "search" for r in rows)
        assert all(r["messages"][-1]["content"].startswith(r["messages"][1]["tool_calls"][0]["function"]["arguments"]
                                                           ["query"]) for r in rows)
    asked = {s["messages"][0]["content"] for s in shorts}
    assert len(shorts) > 100 and len(asked & {p["messages"][1]["content"] for p in practice}) <= 3
    assert len(check) == 64 and sum(c["messages"][0]["content"] in asked for c in check) <= 3
    assert f"checkpoint.load={out / 'reading_warmup' / 'checkpoints'}" in cmds[2] and "sft_practice.jsonl: 0.3" in cmds[2]
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["heldout"]) == {"sft", "grpo"}
    results = [json.loads(line) for line in (out / "eval" / "results.jsonl").open()]
    for name, row in rep["heldout"].items():
        assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["effective_calls"] <= row["tool_calls"]
        mine = [r for r in results if r["model"] == name]
        assert row["broken_call_episodes"] == sum(any(r["broken"].values()) for r in mine) / len(mine)
    # every held-out question has the same number of samples per model: the paired mean difference is the
    # difference of the two accuracies
    held_out = sum(json.loads(line)["split"] == "test" for line in (out / "qa.jsonl").open())
    diff = rep["grpo_minus_sft"]
    assert diff["questions"] == held_out
    assert abs(diff["difference"] - (rep["heldout"]["grpo"]["accuracy"] - rep["heldout"]["sft"]["accuracy"])) < 1e-9
    assert "GRPO - SFT:" in (out / "report.md").read_text()
    assert len(rep["grpo_reward_first"]) == 1
    # the agent trajectories mix the strategies (demo.strategy_mix); each held-out episode is classified
    tool = [json.loads(line) for line in (out / "sft_tool.jsonl").open()]
    assert {r["metadata"]["strategy"] for r in tool + practice} == {"search", "no_search", "miss", "redundant"}
    for name, table in rep["strategies"].items():
        assert abs(sum(v["share"] for v in table.values()) - 1.0) < 1e-9, (name, table)
    # pass@k of the SFT policy on 3 training questions, 2 samples each, recounted from its result rows
    train_rows = [json.loads(line) for line in (out / "eval_train" / "results.jsonl").open()]
    assert len(train_rows) == 6 and {r["model"] for r in train_rows} == {"sft"}
    # demo.rl_questions: GRPO (and the pass@k) take the questions whose subjects no SFT trajectory saw
    rl = [json.loads(line) for line in (out / "grpo_qa.jsonl").open()]
    rl_subjects = {r["metadata"]["subject"] for r in rl}
    all_train = [json.loads(line) for line in (out / "qa.jsonl").open()]
    assert rl and {r["split"] for r in rl} == {"train"} and len(rl) < sum(r["split"] == "train" for r in all_train)
    sft_ids = {r["metadata"]["qa_id"] for r in tool}
    assert not sft_ids & {r["id"] for r in rl} and {r["id"] for r in train_rows} <= {r["id"] for r in rl}
    by_id = {r["id"]: r for r in all_train}
    assert not rl_subjects & {by_id[i]["metadata"]["subject"] for i in sft_ids}
    assert any(line.startswith("$ megatron-search grpo") and f"data.qa_path={out / 'grpo_qa.jsonl'}" in line
               for line in (out / "demo.log").read_text().splitlines())
    hits = defaultdict(list)
    for r in train_rows:
        hits[r["id"]].append(r["grade"] == "CORRECT")
    assert rep["sft_train_pass_at_k"] == {"k": 2, "questions": 3, "pass_at_k": sum(map(any, hits.values())) / 3,
                                          "pass_at_1": sum(map(sum, hits.values())) / 6}
    # each warm-up checked its skill on held-out drills at its last step (the cap here) and the report says so
    for name in ("warmup", "reading_warmup"):
        w = rep["warmups"][name]
        logged = [json.loads(line) for line in (out / name / "skill_checks.jsonl").open()]
        assert w["step"] == 2 and logged[-1]["iteration"] == 2 and w["accuracy"] == logged[-1]["accuracy"]
        assert ("reached at step 2" if w["reached"] else "NOT reached by step 2") in (out / "report.md").read_text()
    check_names = {json.loads(line)["messages"][1]["content"] for line in (out / "copy_check.jsonl").open()}
    # names of the word pool (demo.name_words): fresh combinations, but a one-word name can recur (11 of 64 here)
    assert len(check_names) == 64 and len(check_names & {c["messages"][1]["content"] for c in copies}) <= 16
    assert sorted(rep["figures"]) == ["grpo_penalties.png", "grpo_rewards.png"]
    assert all((out / f).stat().st_size > 1000 for f in rep["figures"])
    # Everything is done: a second call runs no stage again and rewrites the same report.
    assert main(["demo", *overrides, "--out", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.count("done before") == 7 and json.loads((out / "report.json").read_text())["heldout"] == rep["heldout"]


def test_demo_data_with_a_word_pool_makes_every_invented_word_one_token(tmp_path):
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.data.world import World, word_pool
    from megatron_search.demo.pipeline import Demo

    out = tmp_path / "demo"
    out.mkdir()
    overrides = ["demo.copy_drills=3000", "demo.reading_drills=1000", "demo.practice_worlds=1", "demo.name_words=600"]
    demo = Demo(out, str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"), overrides)
    demo.build_data()
    tok = BPETokenizer.load(out / "tokenizer.json")
    assert tok.vocab_size == 2048  # the model's embeddings: 1,448 BPE ids and the 600 words
    pool = set(word_pool(1, 600))  # run.seed 1, as configs/demo.yaml
    world = World.load(out / "world")
    invented = {w for e in world.entities.values() for w in e.name.split() if w in pool}
    assert len(invented) > 250  # 300 entities, most named by one or two pool words
    for w in invented:
        assert len(tok.encode(w)) == 1
    copies = [json.loads(line)["messages"][1]["content"] for line in (out / "sft_copy.jsonl").open()]
    assert all(len([t for t in tok.encode(c) if tok.decode([t]) in pool]) >= 1 for c in copies)
