"""sft.skill_check: an SFT run checks its skill greedily and stops once the threshold is reached; a missed
check logs what it expected and what it got; the greedy decode equals transformers' greedy generate on the
same weights; a resumed run that reached it does nothing; a layout the check cannot decode on is refused
when the config is built."""
from __future__ import annotations

import json

import pytest
import torch

from _sft_helpers import sft_config, train_tokenizer, write_dataset


@pytest.mark.e2e
def test_skill_check_stops_the_run_and_decodes_as_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder
    from megatron_search.train.sft import run_sft
    from megatron_search.train.skill_check import greedy_decode
    from megatron_search.weights.convert import convert

    train_tokenizer(tmp_path)
    data = write_dataset(tmp_path / "one.jsonl", [3])  # one example, memorised: its own check set
    overrides = ["sft.steps=120", "sft.packing=false", f"sft.skill_check.path={data}", "sft.skill_check.every=5",
                 "sft.skill_check.threshold=1.0", "sft.skill_check.max_new_tokens=16", "checkpoint.save_interval=1000"]
    cfg = sft_config(tmp_path, {data: 1.0}, overrides)
    enc = ChatEncoder(BPETokenizer.load(tmp_path), ChatFormat("qwen3"))
    ex = json.loads(data.read_text())
    prompt = enc.prompt_ids(ex["messages"][:-1], ex["tools"])
    seen = {}

    def on_start(trainer):
        seen["trainer"] = trainer

    def on_step(it, m):  # the decode after the last step, taken from the training model itself
        seen[it] = greedy_decode(seen["trainer"].model[0], [prompt], enc.stop_ids, 16, enc.tokenizer.pad_id)[0]

    summary = run_sft(cfg, on_step=on_step, on_start=on_start)
    checks = summary["skill_checks"]
    last = summary["iterations"][-1]
    assert summary.get("skill_reached") and last < 120, summary
    assert [c["iteration"] for c in checks] == list(range(5, last + 1, 5))
    assert all(not c["reached"] for c in checks[:-1]) and checks[-1] == {"iteration": last, "accuracy": 1.0,
                                                                          "reached": True, "misses": []}
    # A missed check names what was expected and what the model answered (the decode after that step).
    answer = ex["messages"][-1]["content"]
    assert all(c["misses"] == [{"expected": answer, "got": enc.parse_turn(seen[c["iteration"]]).content}]
               for c in checks[:-1])
    logged = [json.loads(line) for line in (tmp_path / "run" / "skill_checks.jsonl").open()]
    assert logged == checks
    assert enc.parse_turn(seen[last]).content == ex["messages"][-1]["content"]
    assert summary["checkpoint"].endswith(f"step_{last:08d}")

    # The same weights in transformers, greedy: the same tokens, up to and excluding <|im_end|>.
    convert("mcore_to_hf", f"{summary['checkpoint']}/model_optim", tmp_path / "hf",
            hf_config=str(cfg.model.resolved_hf_config()), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=17, do_sample=False,
                      eos_token_id=enc.stop_ids, pad_token_id=enc.tokenizer.pad_id)[0, len(prompt):].tolist()
    assert out[:len(seen[last])] == seen[last] and out[len(seen[last])] in enc.stop_ids

    # Resumed after the skill was reached: no step is taken.
    again = run_sft(sft_config(tmp_path, {data: 1.0}, [*overrides, "checkpoint.resume=true"]))
    assert again.get("skill_reached") and again["iterations"] == []


def test_skill_check_refuses_a_layout_it_cannot_decode_on(tmp_path):
    with pytest.raises(ValueError, match="sft.skill_check"):
        sft_config(tmp_path, {tmp_path / "x.jsonl": 1.0}, [f"sft.skill_check.path={tmp_path / 'x.jsonl'}",
                                                          "parallel.tp=2"], world=2)


def test_skill_check_rejects_examples_without_an_answer(tmp_path):
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder
    from megatron_search.train.skill_check import SkillCheck

    train_tokenizer(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = sft_config(tmp_path, {bad: 1.0}, [f"sft.skill_check.path={bad}"])
    with pytest.raises(ValueError, match=r"bad.jsonl \(row 1\)"):
        SkillCheck(cfg, ChatEncoder(BPETokenizer.load(tmp_path), ChatFormat("qwen3")))
