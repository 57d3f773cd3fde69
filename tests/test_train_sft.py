"""SFT at 1 process: assistant-only loss mask checked by hand, packing/labels, and a short run whose
loss falls on a repeated batch."""
from __future__ import annotations

import math

import pytest
import torch

from _sft_helpers import TOOLS, conversation, sft_config, write_dataset

from megatron_search.config import dump_config


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from _sft_helpers import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    return d


def _runs(mask):
    """(start, stop) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_assistant_only_mask_on_a_rendered_example(tok_dir):
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.train.sft_data import tokenize_example

    tok = BPETokenizer.load(tok_dir)
    ex = tokenize_example(conversation(0), tok, ChatFormat("qwen3"), "test")
    # Written by hand from the Qwen3 template: what the model must generate in each assistant turn.
    expected_targets = [
        'Let me search.\n<tool_call>\n{"name": "search_web", "arguments": {"query": "Varnholt founded"}}\n'
        "</tool_call><|im_end|>",
        "Varnholt was founded in 1900.<|im_end|>",
    ]
    runs = _runs(ex.mask)
    assert [tok.decode(ex.ids[a:b]) for a, b in runs] == expected_targets
    # Everything else (system + tools, user turn, tool response, assistant headers) carries no loss.
    context = "".join(tok.decode(ex.ids[a:b]) for a, b in zip([0] + [r[1] for r in runs], [r[0] for r in runs] + [None]))
    assert context.startswith("<|im_start|>system\nYou are a helpful search assistant.\n\n# Tools")
    assert "<|im_start|>user\nWhen was Varnholt founded?<|im_end|>\n<|im_start|>assistant\n" in context
    assert "<tool_response>\n[1] Varnholt - Varnholt was founded in 1900.\n</tool_response>" in context
    assert "Let me search" not in context and "founded in 1900.<|im_end|>" not in context
    # The ids are the rendering's tokens: decoding all of them gives the template text back.
    assert tok.decode(ex.ids) == ChatFormat("qwen3").render(conversation(0)["messages"], TOOLS)


def test_qwen3_5_think_mode_mask_starts_after_the_generation_prefix():
    """Qwen3.5 opens `<think>` in the generation prefix, so the model's tokens (the loss) start after it."""
    from megatron_search.chat.format import ChatFormat
    from megatron_search.train.sft_data import segment_conversation

    msgs = [{"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Searching.", "tool_calls": [{"name": "search_web", "arguments": {"query": "x"}}]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "Done.", "reasoning_content": "ok"}]
    assert segment_conversation(ChatFormat("qwen3_5"), msgs, None, "t") == [
        ("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("\n</think>\n\nSearching.\n\n<tool_call>\n<function=search_web>\n<parameter=query>\nx\n</parameter>\n"
         "</function>\n</tool_call><|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
        ("ok\n</think>\n\nDone.<|im_end|>", 1),
        ("\n", 0),
    ]


def test_packed_batch_labels_and_mask_align(tmp_path, tok_dir):
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.train.sft_data import SFTBatcher, tokenize_example

    tok = BPETokenizer.load(tok_dir)
    fmt = ChatFormat("qwen3")
    rows = [dict(conversation(i), _where=f"r{i}") for i in range(3)]
    exs = [tokenize_example(r, tok, fmt, "t") for r in rows]
    width = max(len(e.ids) for e in exs) * 2  # two examples fit per row
    b = SFTBatcher({"a": rows}, {"a": 1.0}, tok, fmt, seq_length=width - 1, global_batch_size=2, packing=True, seed=0)
    batch = b.next_batch()
    assert batch.tokens.shape == (2, width - 1)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])  # labels are the next tokens
    # Each row holds whole examples back to back; the loss mask marks exactly their target tokens.
    by_len = {len(e.ids): e for e in exs}
    for r in range(2):
        full = torch.cat([batch.tokens[r, :1], batch.labels[r]]).tolist()
        mask = [0.0] + batch.loss_mask[r].tolist()
        pos = 0
        while pos < len(full) and full[pos] != tok.pad_id:
            e = next(e for e in exs if full[pos:pos + len(e.ids)] == e.ids)
            assert mask[pos:pos + len(e.ids)] == [float(m) for m in e.mask]
            pos += len(e.ids)
        assert pos > 0 and all(m == 0 for m in mask[pos:])
    assert by_len  # three distinct examples were available
    # The sampler state restores the data position exactly.
    state = b.state_dict()
    nxt = b.next_batch()
    b2 = SFTBatcher({"a": rows}, {"a": 1.0}, tok, fmt, seq_length=width - 1, global_batch_size=2, packing=True, seed=0)
    b2.load_state_dict(state)
    again = b2.next_batch()
    assert torch.equal(nxt.tokens, again.tokens) and torch.equal(nxt.loss_mask, again.loss_mask)


@pytest.mark.e2e
def test_sft_loss_is_finite_and_falls_on_a_repeated_batch(tmp_path, tok_dir, monkeypatch, capsys):
    """Through the `megatron-search sft` command (in this process)."""
    from megatron_search.cli import main
    from megatron_search.train import sft

    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    data = write_dataset(tmp_path / "one.jsonl", [3])  # one example: every batch is the same
    cfg = sft_config(tmp_path, {data: 1.0}, ["sft.steps=3", "sft.packing=false"])
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    summaries = []
    real_run = sft.run_sft
    monkeypatch.setattr(sft, "run_sft", lambda c: summaries.append(real_run(c)) or summaries[-1])
    assert main(["sft", str(tmp_path / "cfg.yaml")]) == 0
    assert "sft done: step 3" in capsys.readouterr().out
    summary = summaries[0]
    losses = summary["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Untrained: about ln(2048) per token; a repeated batch must then be fitted better and better.
    assert abs(losses[0] - math.log(2048)) < 1.0
    assert losses[2] < losses[1] < losses[0]
    assert summary["checkpoint"].endswith("step_00000003")
    # A second stage started from those weights (checkpoint.load, no resume): fresh step counter and
    # optimizer, but its first loss is already below the first run's last one (a fresh start is ~ln 2048).
    cfg2 = sft_config(tmp_path, {data: 1.0}, ["sft.steps=1", "sft.packing=false", f"checkpoint.load={summary['checkpoint']}",
                                              f"run.output_dir={tmp_path / 'stage2'}", f"checkpoint.dir={tmp_path / 'ck2'}"])
    stage2 = real_run(cfg2)
    assert stage2["iterations"] == [1] and stage2["losses"][0] < losses[2]
    # A training checkpoint (no hf_extra) converts to an HF directory that transformers loads.
    from transformers import AutoModelForCausalLM

    from megatron_search.weights.convert import convert

    convert("mcore_to_hf", f"{summary['checkpoint']}/model_optim", tmp_path / "hf",
            hf_config=str(cfg.model.resolved_hf_config()), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.vocab_size == cfg.model.architecture.vocab_size


def test_bad_inputs_fail_clearly(tmp_path, tok_dir):
    from megatron_search.data.jsonl import DataError
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.train.sft_data import load_sft_datasets, tokenize_example, tokenizer_for

    tok = BPETokenizer.load(tok_dir)
    with pytest.raises(DataError, match="only \\['assistant'\\]"):
        tokenize_example(dict(conversation(0), loss_roles=["user"]), tok, ChatFormat("qwen3"), "x")
    with pytest.raises(DataError, match="no assistant message"):
        tokenize_example({"messages": [{"role": "user", "content": "hi"}]}, tok, ChatFormat("qwen3"), "x")
    with pytest.raises(DataError, match="no such file"):
        load_sft_datasets({str(tmp_path / "missing.jsonl"): 1.0})
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg = sft_config(tmp_path, {"x.jsonl": 1.0}, ["model.tokenizer=qwen"])
    with pytest.raises(DataError, match="only 2048 embeddings"):
        tokenizer_for(cfg.model)


def test_data_order_does_not_depend_on_where_the_files_live(tok_dir):
    """The same datasets under two directories give the same batches (the mix is keyed by the shortest
    distinguishing trailing path, not the full path); a state saved with full-path keys still loads."""
    from megatron_search.data.jsonl import DataError
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.train.sft_data import SFTBatcher, location_free_names

    assert location_free_names(["/x/run1/tool.jsonl", "/x/run1/read.jsonl"]) == {
        "/x/run1/tool.jsonl": "tool.jsonl", "/x/run1/read.jsonl": "read.jsonl"}
    assert location_free_names(["/d/a/train.jsonl", "/d/b/train.jsonl"]) == {
        "/d/a/train.jsonl": "a/train.jsonl", "/d/b/train.jsonl": "b/train.jsonl"}
    with pytest.raises(DataError, match="the same file is listed twice"):
        location_free_names(["/d/a.jsonl", "/d/./a.jsonl"])
    tok, fmt = BPETokenizer.load(tok_dir), ChatFormat("qwen3")
    rows = {"tool": [dict(conversation(i), _where=f"t{i}") for i in range(5)],
            "read": [dict(conversation(i + 5), _where=f"r{i}") for i in range(5)]}

    def batcher(root: str) -> SFTBatcher:
        data = {f"{root}/{k}.jsonl": v for k, v in rows.items()}
        weights = {f"{root}/tool.jsonl": 0.7, f"{root}/read.jsonl": 0.3}
        return SFTBatcher(data, weights, tok, fmt, seq_length=512, global_batch_size=4, packing=False, seed=3)

    a, b = batcher("/runs/one"), batcher("/elsewhere/two")
    for _ in range(3):
        assert torch.equal(a.next_batch().tokens, b.next_batch().tokens)
    # a checkpoint written when the sampler was keyed by full paths resumes at the same position
    state = a.state_dict()
    old = {"sampler": {**state["sampler"], **{k: {f"/runs/one/{n}": v for n, v in state["sampler"][k].items()}
                                              for k in ("counts", "credit")}}}
    c = batcher("/runs/one")
    c.load_state_dict(old)
    assert torch.equal(a.next_batch().tokens, c.next_batch().tokens)


def test_trimmed_batches_cut_only_padding_and_keep_the_loss(tok_dir):
    """sft.trim_padding: a batch is cut to its longest row (rounded up to the multiple); the columns
    cut are padding with loss 0, and a causal LM's masked cross-entropy (a tiny HF Qwen3-MoE) is the
    same on the cut batch as on the full-width one (to float32 rounding: the matmul shapes differ)."""
    import transformers

    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.train.sft_data import SFTBatcher

    tok, fmt = BPETokenizer.load(tok_dir), ChatFormat("qwen3")
    rows = {"a": [dict(conversation(i), _where=f"a{i}") for i in range(6)]}

    def batcher(trim):
        return SFTBatcher(rows, {"a": 1.0}, tok, fmt, seq_length=512, global_batch_size=3, packing=False, seed=1,
                          trim_multiple=trim)

    full, cut1, cut8 = batcher(None), batcher(1), batcher(8)
    for _ in range(2):
        f, c1, c8 = full.next_batch(), cut1.next_batch(), cut8.next_batch()
        assert f.tokens.shape[1] == 512
        # the longest row's last target is the last non-pad label column of the full batch
        longest = int((f.labels != tok.pad_id).any(0).nonzero().max()) + 1
        assert c1.tokens.shape[1] == longest < 512
        assert c8.tokens.shape[1] == -(-longest // 8) * 8
        for c in (c1, c8):
            w = c.tokens.shape[1]
            assert torch.equal(c.tokens, f.tokens[:, :w]) and torch.equal(c.labels, f.labels[:, :w])
            assert torch.equal(c.loss_mask, f.loss_mask[:, :w])
        assert f.loss_mask[:, c1.tokens.shape[1]:].sum() == 0

    hf = transformers.AutoConfig.from_pretrained("configs/models/tiny_qwen3_moe")
    assert hf.vocab_size > max(int(f.tokens.max()), tok.pad_id)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf).eval()

    def ce(batch):
        with torch.no_grad():
            logits = model(input_ids=batch.tokens).logits
        per_tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.labels, reduction="none")
        return float((per_tok * batch.loss_mask).sum() / batch.loss_mask.sum())

    assert ce(c1) == pytest.approx(ce(f), rel=1e-5, abs=0)

    with pytest.raises(ValueError, match="trim_multiple=5 must be >= 1 and divide seq_length=512"):
        batcher(5)
