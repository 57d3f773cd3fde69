"""A tiny embedded world for GRPO tests: QA JSONL, search index, tokenizer, a briefly trained RM."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TINY = "configs/models/tiny_qwen3_moe"


def build(root: Path, hf_config: str = TINY) -> dict[str, str]:
    """The world under `root`, with a reward model of the `hf_config` policy (the RM starts from its architecture)."""
    from megatron_search.config import load_config
    from megatron_search.data.demo_tasks import one_hop_records, one_hop_sft_examples
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.world import build_world
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.search.local import build_index
    from megatron_search.search.tool import SearchTool

    world = build_world(seed=5, num_entities=60, filler_docs=10)
    docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
    build_index(docs, root / "index", progress=False)
    recs = one_hop_records(world)
    write_jsonl(root / "qa.jsonl", [r.to_dict() for r in recs])
    cfg = load_config(None, ["search.max_results=2", f"search.index_dir={root / 'index'}"])
    examples, _ = one_hop_sft_examples(recs[:20], SearchTool.from_config(cfg.search))
    fmt = ChatFormat(style="qwen3")
    tok = BPETokenizer.train([d["text"] for d in docs] + [fmt.render(e.messages, e.tools) for e in examples],
                             vocab_size=1024)
    tok.save(root / "tokenizer.json")
    common = [f"model.hf_config={hf_config}", "model.init=random", f"model.tokenizer={root / 'tokenizer.json'}",
              "search.max_results=2",
              "search.snippet_chars=120", f"search.index_dir={root / 'index'}"]
    rm_out = root / "rm"
    subprocess.run([sys.executable, "-m", "megatron_search.cli", "rm", "train", *common, f"run.output_dir={rm_out}",
                    "rm.steps=2", "rm.global_batch_pairs=4", "rm.micro_batch_pairs=2", "--demo", "16"],
                   check=True, capture_output=True, text=True, timeout=600)
    return {"common": common, "qa": str(root / "qa.jsonl"), "rm": str(rm_out / "checkpoints")}


def grpo_overrides(fx: dict, out: Path, steps: int = 2) -> list[str]:
    return [*fx["common"], f"run.output_dir={out}", f"data.qa_path={fx['qa']}", "data.mix={qa: 1.0}",
            f"rm.load={fx['rm']}", f"grpo.steps={steps}", "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.micro_batch_size=1", "rollout.max_new_tokens=16", "rollout.max_total_tokens=512",
            "rollout.max_turns=2", "optim.lr=1e-3", "checkpoint.save_interval=1000",
            "logging.progress_bars=false"]


def grpo_worker(rank: int, world: int, port: int, layouts: list, fx: dict, root: str) -> None:
    """Each layout in turn on one process group (run_grpo re-creates Megatron's groups on it)."""
    import os

    import torch.distributed as dist

    from megatron_search.config import load_config
    from megatron_search.train.grpo import run_grpo

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, overrides in layouts:
            cfg = load_config(None, grpo_overrides(fx, Path(root) / name) + [f"parallel.world_size={world}", *overrides])
            run_grpo(cfg)
    finally:
        dist.destroy_process_group()
