"""Shared pieces of the SFT / resume tests: a tiny chat dataset, a tiny BPE trained on it, configs."""
from __future__ import annotations

import json
from pathlib import Path

TOOLS = [{"type": "function", "function": {"name": "search_web", "description": "Search the web.",
                                            "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                           "required": ["query"]}}}]
ENTITIES = ["Varnholt", "Quessa", "Tirelle", "Obrask", "Maunder", "Pelliva", "Zorath", "Kestrin"]


def conversation(i: int) -> dict:
    name = ENTITIES[i % len(ENTITIES)]
    year = 1900 + 7 * i
    return {
        "id": f"ex{i}",
        "messages": [
            {"role": "system", "content": "You are a helpful search assistant."},
            {"role": "user", "content": f"When was {name} founded?"},
            {"role": "assistant", "content": "Let me search.",
             "tool_calls": [{"type": "function", "function": {"name": "search_web", "arguments": {"query": f"{name} founded"}}}]},
            {"role": "tool", "name": "search_web", "content": f"[1] {name} - {name} was founded in {year}."},
            {"role": "assistant", "content": f"{name} was founded in {year}."},
        ],
        "tools": TOOLS,
        "loss_roles": ["assistant"],
    }


def write_dataset(path: Path, indices) -> Path:
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in indices))
    return path


def train_tokenizer(out_dir: Path) -> Path:
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer

    fmt = ChatFormat("qwen3")
    texts = [fmt.render(c["messages"], c["tools"]) for c in (conversation(i) for i in range(16))]
    # Qwen's pattern (spaces glued to words): the fixtures' seq_length=224 is sized for its token counts.
    return BPETokenizer.train(texts * 4, vocab_size=600, pretokenizer="qwen").save(out_dir)


def sft_config(tmp: Path, datasets: dict, overrides=(), world: int = 1):
    from megatron_search.config import load_config

    tok = tmp / "tokenizer.json"
    if not tok.exists():
        train_tokenizer(tmp)
    mix = "{" + ", ".join(f"{p}: {w}" for p, w in datasets.items()) + "}"
    return load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"), [
        f"model.tokenizer={tok}", "model.chat_style=qwen3", f"sft.datasets={mix}", "sft.seq_length=224",
        "sft.global_batch_size=4", "sft.micro_batch_size=2", "sft.steps=2", "optim.lr=3e-3",
        f"run.output_dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.save_interval=100",
        "logging.progress_bars=false", f"parallel.world_size={world}", *overrides,
    ])
