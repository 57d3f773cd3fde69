"""A two-behaviour world for the GRPO learning test (tests/test_grpo_learns.py).

Every question is "Does this question mention <name>? Answer yes or no." about an invented name, so
the correct answer is always "yes": the rewarded choice does not depend on the question and carries
over to held-out names. The SFT data gives every training question twice, answered "yes" in one file and
"no" in the other, mixed 0.5 / 0.5, so the SFT policy answers each question 50/50 (measured: p(yes) = 0.494,
p(no) = 0.499 for every name) and GRPO starts from ~50% correct.
With the tool and length penalties off (reward.lambda_tool = reward.lambda_len = 0) the gated reward
is R = r_base * s: 0 for "no", the reward model's s > 0 for "yes".

`pipeline_worker` runs the stack's own entry points in one spawned process: run_sft (SFT from
scratch), `megatron-search rm train` (a one-step reward model: only s > 0 matters here), then
run_grpo once per plan entry (the learning run and its lr = 0 control). `rewarded_rate` samples an HF
checkpoint through the local CPU engine and the agent loop and classifies each answer.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "configs/models/tiny_qwen3_moe"
CONFIG = str(REPO / "configs/tiny_cpu.yaml")
QUESTION = "Does this question mention {name}? Answer yes or no."
REWARDED, OTHER = "yes", "no"
PROMPTS_PER_STEP, GROUP_SIZE = 4, 8
SYLLABLES = ["ka", "lo", "mi", "ra", "ve", "to", "su", "ne", "bar", "dun", "fel", "gor", "hal", "jin", "kor",
             "lum", "mor", "nes", "pra", "quin", "rel", "sto", "tar", "vol", "wen", "zed"]


def invented_names(n: int, seed: int) -> list[str]:
    """n distinct invented names of two or three syllables."""
    rng, names = random.Random(seed), set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize())
    return sorted(names)


def build(root: Path, n_train: int = 48, n_test: int = 48, seed: int = 0) -> dict:
    """QA JSONL (train + held-out test names), the two SFT answer files, a small search index, a BPE, a model config."""
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.sft import SYSTEM_PROMPT
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.search.local import build_index
    from megatron_search.search.tool import SearchTool

    names = invented_names(n_train + n_test, seed)
    random.Random(seed + 1).shuffle(names)
    train, test = names[:n_train], names[n_train:]
    qa = [{"id": f"{split}-{i}", "question": QUESTION.format(name=name), "answers": [REWARDED], "source": "learning-test",
           "split": split} for split, group in (("train", train), ("test", test)) for i, name in enumerate(group)]
    write_jsonl(root / "qa.jsonl", qa)
    docs = [{"id": f"d{i}", "title": name, "url": f"https://example.org/{name}", "text": f"{name} is an invented name."}
            for i, name in enumerate(train[:8])]
    build_index(docs, root / "index", progress=False)
    tools = [SearchTool(None, max_results=2, max_query_chars=250, max_calls=5).spec]
    sft = {answer: [{"id": f"sft-{i}-{answer}", "messages": [
        {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION.format(name=name)},
        {"role": "assistant", "content": answer}], "tools": tools, "loss_roles": ["assistant"]}
        for i, name in enumerate(train)] for answer in (REWARDED, OTHER)}
    for answer, rows in sft.items():
        write_jsonl(root / f"sft_{answer}.jsonl", rows)
    fmt = ChatFormat("qwen3")
    texts = [fmt.render(e["messages"], e["tools"]) for rows in sft.values() for e in rows] + [d["text"] for d in docs]
    tok = BPETokenizer.train(texts, vocab_size=1024, pretokenizer="qwen")
    tok.save(root / "tokenizer.json")
    # The tiny model with exactly the tokenizer's ids: every id it can sample decodes (as the demo requires).
    hf = json.loads((MODEL / "config.json").read_text())
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({**hf, "vocab_size": tok.vocab_size}, indent=1))
    return {"root": str(root), "qa": str(root / "qa.jsonl"),
            "sft": {str(root / f"sft_{answer}.jsonl"): 0.5 for answer in sft},
            "test_questions": [QUESTION.format(name=n) for n in test],
            "common": [f"model.hf_config={root / 'model'}", f"model.tokenizer={root / 'tokenizer.json'}", "model.chat_style=qwen3",
                       "model.params_dtype=float32", f"search.index_dir={root / 'index'}", "search.max_results=2",
                       "logging.progress_bars=false"]}


def sft_overrides(fx: dict, steps: int, lr: float, seed: int) -> list[str]:
    out = Path(fx["root"]) / "sft"
    """SFT from scratch on the two answer files mixed 0.5 / 0.5: the mix sampler's weighted round-robin puts
    exactly as many of each in every batch, so no run of unlucky batches tilts the policy before GRPO."""
    mix = "{" + ", ".join(f"{path}: {w}" for path, w in fx["sft"].items()) + "}"
    return [*fx["common"], f"sft.datasets={mix}", "sft.packing=false", "sft.seq_length=512",
            "sft.global_batch_size=16", "sft.micro_batch_size=16", f"sft.steps={steps}", f"optim.lr={lr}",
            "optim.lr_schedule=constant", "optim.warmup_steps=0", f"run.output_dir={out}",
            f"checkpoint.save_interval={steps}", f"run.seed={seed}"]


def rm_args(fx: dict) -> list[str]:
    return ["rm", "train", *fx["common"], f"run.output_dir={Path(fx['root']) / 'rm'}", "rm.steps=1",
            "rm.global_batch_pairs=4", "rm.micro_batch_pairs=4", "--demo", "8"]


def grpo_overrides(fx: dict, name: str, steps: int, lr: float, seed: int, extra=()) -> list[str]:
    """GRPO on the train questions. One micro-batch per update (half the rollouts each), so a part that holds only
    padding rows is skipped whole (policy_step skips parts without a trained token). optim.adam_eps=1e-3: at an
    LR ~1000x the recipe's, plain Adam (eps 1e-8) moves every weight by ~lr whatever its gradient, so one update
    could jump the policy by a KL of 2-7 (about one run in five here with eps 1e-8 to 1e-4 and lr 1e-3 to 2e-3,
    warm-up or not: the answer loses its <|im_end|>, correctness falls to ~0 and sometimes never returns);
    eps=1e-3 keeps small gradients SGD-like (step ~ lr * g / eps) and caps large ones at ~lr: over 8 seeds the
    largest KL between updates stayed below 0.35 and every run learned."""
    root = Path(fx["root"])
    return [*fx["common"], f"run.output_dir={root / name}", f"run.seed={seed}", f"data.qa_path={fx['qa']}",
            "data.mix={qa: 1.0}", f"rm.load={root / 'rm' / 'checkpoints'}", f"checkpoint.load={root / 'sft' / 'checkpoints'}",
            f"grpo.steps={steps}", f"grpo.prompts_per_step={PROMPTS_PER_STEP}", f"grpo.group_size={GROUP_SIZE}",
            f"grpo.micro_batch_size={PROMPTS_PER_STEP * GROUP_SIZE // 2}",
            "grpo.updates_per_batch=2", "rollout.max_new_tokens=8", "rollout.max_total_tokens=512",
            "rollout.max_turns=1", "rollout.temperature=1.0", "reward.lambda_tool=0", "reward.lambda_len=0",
            "reward.answer_match=exact", f"optim.lr={lr}", "optim.lr_schedule=constant", "optim.warmup_steps=0",
            "optim.adam_eps=1e-3", "checkpoint.save_interval=1000", *extra]


def pipeline_worker(rank: int, world: int, port: int, fx: dict, plan: dict) -> None:
    """SFT -> reward model -> one GRPO run per plan["grpo"] entry (name, overrides), in this process."""
    import os
    import time

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(plan.get("threads", 1))
    from megatron_search.cli import main
    from megatron_search.config import load_config
    from megatron_search.train.grpo import run_grpo
    from megatron_search.train.sft import run_sft

    times = {}
    if plan.get("sft"):
        t = time.perf_counter()
        run_sft(load_config(CONFIG, plan["sft"]))
        times["sft"] = time.perf_counter() - t
        t = time.perf_counter()
        assert main(plan["rm"]) == 0
        times["rm"] = time.perf_counter() - t
    for name, overrides in plan["grpo"]:
        t = time.perf_counter()
        run_grpo(load_config(CONFIG, overrides))
        times[name] = time.perf_counter() - t
    (Path(fx["root"]) / "times.json").write_text(json.dumps(times))


def rewarded_rate(fx: dict, hf_dir: str | Path, samples: int = 4, seed: int = 0, extra=()) -> dict:
    """Sample every held-out question `samples` times from the HF checkpoint through the local engine and the
    agent loop (the training prompt and sampling settings); count the answers by form."""
    import asyncio

    from megatron_search.config import load_config
    from megatron_search.data.mix import MixItem
    from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
    from megatron_search.rollout.local.engine import LocalEngine
    from megatron_search.search.tool import SearchTool
    from megatron_search.train.grpo_data import with_system_prompt
    from megatron_search.train.grpo_driver import build_encoder

    cfg = load_config(CONFIG, grpo_overrides(fx, "eval", 1, 1e-3, seed, extra))
    engine = LocalEngine(hf_dir, dtype="float32", seed=seed)
    agent = SearchAgent(engine, build_encoder(cfg.model), SearchTool.from_config(cfg.search),
                        AgentSettings.for_training(cfg.rollout))
    tasks = [AgentTask(with_system_prompt(MixItem(f"t{i}", "qa", "qa", [{"role": "user", "content": q}])).messages,
                       seed=seed * 100_003 + i * samples + k)
             for i, q in enumerate(fx["test_questions"]) for k in range(samples)]

    async def go():
        try:
            return await agent.run_many(tasks, progress=False)
        finally:
            await engine.close()

    rollouts = asyncio.run(go())
    forms = [(r.final_answer or "").strip() for r in rollouts]  # exact forms, not the reward's matcher
    n = len(forms)
    return {"n": n, "rewarded": sum(f == REWARDED for f in forms) / n, "other": sum(f == OTHER for f in forms) / n,
            "malformed": sum(f not in (REWARDED, OTHER) for f in forms) / n}
