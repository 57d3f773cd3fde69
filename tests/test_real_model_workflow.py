"""The real-model workflow on tiny checkpoints: one model path supplies the architecture, tokenizer, chat format
and initial weights; SFT starts from the pretrained weights (an HF directory or its `convert hf-to-mcore`
output); a training stage without initial weights, and a chat style the model was not trained on, are refused;
what we write out is a complete HF directory.

The HF directory is made by transformers (`save_pretrained` of a random-weight Qwen3-MoE) with a tokenizer.json
trained by `tokenizers`; the reference loss is transformers' own cross entropy on the SFT run's first batch.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _sft_helpers import train_tokenizer, write_dataset

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "models" / "tiny_qwen3_moe"
Q35_397B = REPO / "configs" / "models" / "qwen3_5_397b_a17b"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A complete tiny Qwen3-MoE HF directory: config, random weights (seeded), tokenizer.json, side files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("hf_qwen3_moe")
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY)), dtype=torch.float32)
    with torch.no_grad():  # logits ~30x a fresh init's: a loss far from any random init's (about ln V)
        model.model.norm.weight.fill_(30.0)
    model.save_pretrained(str(out))
    train_tokenizer(out)  # tokenizer.json beside the weights
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    return out


def _tokens_loss(model_dir: Path, batch, parts: int = 1) -> float:
    """transformers' token-mean cross entropy of `batch` (tokens -> labels under loss_mask), float64 sums; with
    `parts` > 1 the mean of each contiguous part's token mean (what a step over that many micro-batches, or
    data-parallel ranks of one micro-batch each, reports)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens).logits.double()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    ce, mask = ce.view_as(batch.labels), batch.loss_mask.double()
    per = batch.tokens.shape[0] // parts
    means = [float((ce[i:i + per] * mask[i:i + per]).sum() / mask[i:i + per].sum())
             for i in range(0, batch.tokens.shape[0], per)]
    return sum(means) / len(means)


def _sft_cfg(tmp: Path, start: list[str], steps: int = 1, world: int = 1):
    """One SFT step on 4 examples, one micro-batch per data-parallel rank unless `start` says otherwise; the
    tokenizer and chat style are the model's own (from model.path), not overrides."""
    from megatron_search.config import load_config

    tmp.mkdir(parents=True, exist_ok=True)
    data = write_dataset(tmp / "data.jsonl", range(8))
    return load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [
        f"sft.datasets={{{data}: 1.0}}", "sft.seq_length=224", "sft.global_batch_size=4", "sft.micro_batch_size=4",
        f"sft.steps={steps}", "optim.lr=1e-4", f"run.output_dir={tmp / 'run'}", f"checkpoint.dir={tmp / 'ckpt'}",
        "checkpoint.save_interval=100", "logging.progress_bars=false", f"parallel.world_size={world}", *start])


def _first_batch(cfg):
    from megatron_search.train.sft import build_batcher

    return build_batcher(cfg).next_batch()


# ---- config: one model path ---------------------------------------------------------------------------------

def test_model_path_supplies_architecture_tokenizer_and_chat_style(hf_dir):
    from megatron_search.config import load_config

    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [f"model.path={hf_dir}", "model.hf_config=",
                                                               "model.init=pretrained"])
    assert Path(cfg.model.hf_config) == hf_dir
    assert Path(cfg.model.tokenizer) == hf_dir / "tokenizer.json"
    assert cfg.model.chat_style == "qwen3"
    assert cfg.model.engine_dir() == hf_dir


def test_397b_config_takes_the_model_directorys_tokenizer_and_qwen3_5_chat_style(tmp_path):
    from megatron_search.config import load_config
    from megatron_search.launch.slurm_plan import sglang_argv

    model = tmp_path / "Qwen3.5-397B-A17B"
    model.mkdir()
    shutil.copy(Q35_397B / "config.json", model / "config.json")  # the real config; weights are not needed here
    train_tokenizer(model)
    cfg = load_config(str(REPO / "configs" / "qwen3_5_397b_a17b_grpo.yaml"), [f"model.path={model}"])
    assert cfg.model.chat_style == "qwen3_5"
    assert Path(cfg.model.tokenizer) == model / "tokenizer.json"
    # no weights in the directory: the engines start from it (its side files) with dummy weights
    argv = sglang_argv(cfg, str(cfg.model.engine_dir()), 30000, 1, 0, "")
    assert argv[argv.index("--model-path") + 1] == str(model) and "dummy" in argv


def test_a_chat_style_the_model_was_not_trained_on_is_refused():
    from megatron_search.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.chat_style: 'qwen3' is not the chat format .*qwen3_5"):
        load_config(str(REPO / "configs" / "tiny_qwen3_5_cpu.yaml"), ["model.chat_style=qwen3"])


def test_training_without_initial_weights_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_search.cli", "config", "--stage", "sft",
                           str(REPO / "configs" / "qwen3_5_397b_a17b_sft.yaml")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and problems[0].strip().startswith("model.path:"), proc.stderr


def test_a_path_without_weights_and_the_old_field_are_refused(tmp_path):
    from megatron_search.config import ConfigError, load_config

    empty = tmp_path / "m"
    empty.mkdir()
    shutil.copy(TINY / "config.json", empty / "config.json")
    train_tokenizer(empty)
    with pytest.raises(ConfigError, match=r"model.path: .* holds no weights"):
        load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [f"model.path={empty}", "model.init=pretrained"],
                    stage="sft")
    with pytest.raises(ConfigError, match="model.checkpoint is gone"):
        load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [f"model.checkpoint={empty}"])


# ---- SFT starts from the pretrained weights ------------------------------------------------------------------

@pytest.mark.e2e
def test_sft_from_the_hf_directory_starts_at_transformers_loss(hf_dir, tmp_path):
    from megatron_search.train.sft import run_sft

    cfg = _sft_cfg(tmp_path, [f"model.path={hf_dir}", "model.hf_config=", "model.init=pretrained"])
    assert Path(cfg.model.tokenizer) == hf_dir / "tokenizer.json"
    expected = _tokens_loss(hf_dir, _first_batch(cfg))
    got = run_sft(cfg)["losses"][0]  # step 1's loss: the forward before the first update
    assert got == pytest.approx(expected, rel=1e-4), (got, expected)
    # the random init of the same config is far from it: the weights were loaded, not re-drawn
    rand = run_sft(_sft_cfg(tmp_path / "rand", [f"model.hf_config={hf_dir}", f"model.tokenizer={hf_dir}/tokenizer.json",
                                                "model.init=random"]))["losses"][0]
    assert abs(rand - expected) > 0.1 * expected, (rand, expected)


# TP=2 with sequence parallel (DP=1: one micro-batch of 4); EP=2 (DP=2: one micro-batch of 2 per rank)
PARALLEL_STARTS = {"tp2_sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 1),
                   "ep2": (["parallel.ep=2", "sft.micro_batch_size=2"], 2)}


def _parallel_start_worker(rank: int, world: int, port: int, hf_dir: str, root: str) -> None:
    import torch.distributed as dist

    from megatron_search.distributed import DistEnv
    from megatron_search.train.sft import run_sft

    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    losses = {}
    for name, (layout, _) in PARALLEL_STARTS.items():
        cfg = _sft_cfg(Path(root) / name, [f"model.path={hf_dir}", "model.hf_config=", "model.init=pretrained",
                                           *layout], world=world)
        losses[name] = run_sft(cfg, env=env)["losses"][0]
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_sft_from_the_hf_directory_at_tp2_and_ep2_starts_at_transformers_loss(hf_dir, tmp_path):
    from _mp import run_spawned

    run_spawned(_parallel_start_worker, 2, str(hf_dir), str(tmp_path), timeout_s=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, (layout, parts) in PARALLEL_STARTS.items():
        cfg = _sft_cfg(tmp_path / f"{name}_ref", [f"model.path={hf_dir}", "model.hf_config=",
                                                   "model.init=pretrained", *layout], world=2)
        expected = _tokens_loss(hf_dir, _first_batch(cfg), parts)
        for r, got in enumerate(ranks):
            assert got[name] == pytest.approx(expected, rel=1e-4), (name, r, got[name], expected)


@pytest.mark.e2e
def test_a_requeueable_run_starts_from_the_hf_directory_too(hf_dir, tmp_path):
    from megatron_search.train.sft import run_sft

    # checkpoint.resume=true (as Slurm requeues run): no checkpoint of its own yet, so model.path is loaded
    cfg = _sft_cfg(tmp_path, [f"model.path={hf_dir}", "model.hf_config=", "model.init=pretrained",
                              "checkpoint.resume=true"])
    expected = _tokens_loss(hf_dir, _first_batch(cfg))
    assert run_sft(cfg)["losses"][0] == pytest.approx(expected, rel=1e-4)


def test_qwen3_5_without_its_tokenizer_is_refused(tmp_path):
    from megatron_search.config import ConfigError, load_config

    ckpt = tmp_path / "sft_run"
    (ckpt / "step_00000001").mkdir(parents=True)
    (ckpt / "step_00000001" / "trainer.json").write_text("{}")
    with pytest.raises(ConfigError) as ei:  # GRPO from an SFT run, no model.path: no Qwen3.5 tokenizer named
        load_config(str(REPO / "configs" / "tiny_qwen3_5_cpu.yaml"), [f"checkpoint.load={ckpt}", "model.init=pretrained"],
                    stage="sft")
    assert [p.split(":")[0] for p in ei.value.problems] == ["model.tokenizer"]


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_sft_from_the_converted_megatron_checkpoint_starts_at_transformers_loss(hf_dir, tmp_path):
    from megatron_search.train.sft import run_sft
    from megatron_search.weights.convert import convert

    mcore = tmp_path / "mcore"
    convert("hf_to_mcore", hf_dir, mcore, progress=False)
    cfg = _sft_cfg(tmp_path, [f"model.path={mcore}", "model.hf_config=", "model.init=pretrained"])
    assert Path(cfg.model.tokenizer) == mcore / "hf_extra" / "tokenizer.json"  # its HF side travelled along
    expected = _tokens_loss(hf_dir, _first_batch(cfg))
    assert run_sft(cfg)["losses"][0] == pytest.approx(expected, rel=1e-4)


# ---- complete HF directories out ------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_hf_round_trip_writes_a_complete_directory(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    from megatron_search.weights.convert import convert

    convert("hf_to_mcore", hf_dir, tmp_path / "mcore", progress=False)
    out = tmp_path / "hf"
    convert("mcore_to_hf", tmp_path / "mcore", out, progress=False)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("When was Quessa founded?") == AutoTokenizer.from_pretrained(str(hf_dir)).encode(
        "When was Quessa founded?")


# ---- Qwen3.5: engines start from a complete directory ---------------------------------------------------------

def _qwen3_5_dir(folder: Path, processor: bool) -> Path:
    """A Qwen3.5 HF directory: the real 397B config.json, a tokenizer.json, no weights (engines start dummy); with
    `processor`, the image processor's file saved by transformers (AutoProcessor reads it at engine start-up)."""
    folder.mkdir(parents=True)
    shutil.copy(Q35_397B / "config.json", folder / "config.json")
    train_tokenizer(folder)
    if processor:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2).save_pretrained(str(folder))
    return folder


def test_sglang_from_a_qwen3_5_directory_without_its_processor_files_is_refused(tmp_path):
    from megatron_search.config import ConfigError, load_config

    inputs = [f"checkpoint.load={tmp_path}", "model.init=random", "rm.load=RM", "data.qa_path=QA.jsonl",
              "data.mix={qa: 1.0}"]
    bare = _qwen3_5_dir(tmp_path / "bare", processor=False)
    with pytest.raises(ConfigError) as ei:
        load_config(str(REPO / "configs" / "qwen3_5_397b_a17b_grpo.yaml"), [f"model.path={bare}", *inputs],
                    stage="grpo")
    (line,) = [p for p in ei.value.problems if p.startswith("model.path:")]
    assert "Qwen3_5MoeForConditionalGeneration" in line and "preprocessor_config.json" in line, line
    full = _qwen3_5_dir(tmp_path / "full", processor=True)
    cfg = load_config(str(REPO / "configs" / "qwen3_5_397b_a17b_grpo.yaml"), [f"model.path={full}", *inputs],
                      stage="grpo")
    assert cfg.model.engine_dir() == full
    # an engine given its own directory is not checked against model.path's
    load_config(str(REPO / "configs" / "qwen3_5_397b_a17b_grpo.yaml"),
                [f"model.path={bare}", f"rollout.sglang.model_path={full}", *inputs], stage="grpo")


@pytest.mark.multiprocess
def test_a_qwen3_5_export_keeps_the_processor_and_tokenizer_files(tmp_path):
    """convert hf-to-mcore -> mcore-to-hf of a tiny Qwen3.5-MoE (random weights, transformers' save_pretrained)
    with its processor file: the output loads in transformers (the multimodal model, its tokenizer, its image
    processor) with the same weights, the vision tower's included. AutoProcessor itself also needs torchvision's video processor, which has no CPU build for this torch
    on PyPI, so the image processor (PIL) and the tokenizer are loaded one by one."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen3_5MoeForConditionalGeneration

    from megatron_search.weights.convert import convert

    src = tmp_path / "q35"
    torch.manual_seed(11)
    tiny = REPO / "configs" / "models" / "tiny_qwen3_5_moe"
    Qwen3_5MoeForConditionalGeneration(AutoConfig.from_pretrained(str(tiny))).float().save_pretrained(str(src))
    train_tokenizer(src)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2).save_pretrained(str(src))
    convert("hf_to_mcore", src, tmp_path / "mcore", progress=False)
    out = tmp_path / "hf"
    convert("mcore_to_hf", tmp_path / "mcore", out, progress=False)
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert AutoImageProcessor.from_pretrained(str(out)).to_dict() == AutoImageProcessor.from_pretrained(str(src)).to_dict()
    assert AutoTokenizer.from_pretrained(str(out)).encode("Quessa") == AutoTokenizer.from_pretrained(str(src)).encode(
        "Quessa")
    a = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).state_dict()
    b = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_a_qwen3_5_run_checkpoint_converts_to_the_whole_model(tmp_path):
    """SFT from a tiny Qwen3.5 HF directory (the multimodal class: vision tower included), then `convert
    mcore-to-hf` of the run: the trained language model plus the vision tower the trainer never held (taken from
    model.path), loadable as the full model. The run's config.yaml is made to claim a TP=2, sequence-parallel,
    PP=2 x VPP=2 layout: the conversion runs at its own layout (TP=1) whatever the run used."""
    import yaml
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    from megatron_search.config import load_config
    from megatron_search.train.sft import run_sft
    from megatron_search.weights.convert import convert
    from megatron_search.weights.hf_source import HFTensorSource

    src = tmp_path / "q35"
    torch.manual_seed(5)
    tiny = REPO / "configs" / "models" / "tiny_qwen3_5_moe"
    Qwen3_5MoeForConditionalGeneration(AutoConfig.from_pretrained(str(tiny))).float().save_pretrained(str(src))
    train_tokenizer(src)
    data = write_dataset(tmp_path / "data.jsonl", range(4))
    cfg = load_config(str(REPO / "configs" / "tiny_qwen3_5_cpu.yaml"), [
        f"model.path={src}", "model.hf_config=", "model.init=pretrained", f"sft.datasets={{{data}: 1.0}}",
        "sft.seq_length=768", "sft.global_batch_size=2", "sft.micro_batch_size=2", "sft.steps=1", "optim.lr=1e-2",
        f"run.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "logging.progress_bars=false",
        "parallel.world_size=1"], stage="sft")
    step = Path(run_sft(cfg)["checkpoint"])
    saved = yaml.safe_load((step / "config.yaml").read_text())
    saved["parallel"].update(tp=2, etp=2, sequence_parallel=True, pp=2, vpp=2, world_size=4)
    (step / "config.yaml").write_text(yaml.safe_dump(saved))
    out = tmp_path / "hf"
    convert("mcore_to_hf", tmp_path / "ckpt", out, progress=False)
    before, after = HFTensorSource.from_dir(src), HFTensorSource.from_dir(out)
    assert after.names() == before.names()
    visual = sorted(n for n in before.names() if n.startswith("model.visual."))
    assert visual and all(torch.equal(after.get(n), before.get(n)) for n in visual)
    language = [n for n in before.names() if n.startswith("model.language_model.")]
    assert any(not torch.equal(after.get(n), before.get(n)) for n in language)  # SFT moved them
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(model[1].values()), model[1]  # nothing missing, unexpected or mismatched


@pytest.mark.e2e
def test_a_requeueable_run_starts_from_another_runs_checkpoint_as_model_path(hf_dir, tmp_path):
    """model.path = an SFT run's checkpoint, checkpoint.resume=true and no checkpoint of its own yet: the first
    start loads that run's model only (its step-1 loss is transformers' loss on the run's export), not an error."""
    from megatron_search.train.sft import run_sft
    from megatron_search.weights.convert import convert

    first = run_sft(_sft_cfg(tmp_path / "a", [f"model.path={hf_dir}", "model.hf_config=", "model.init=pretrained"]))
    exported = tmp_path / "a_hf"
    convert("mcore_to_hf", first["checkpoint"], exported, progress=False)
    cfg = _sft_cfg(tmp_path / "b", [f"model.path={tmp_path / 'a' / 'ckpt'}", f"model.hf_config={hf_dir}",
                                    f"model.tokenizer={hf_dir / 'tokenizer.json'}", "model.init=pretrained",
                                    "checkpoint.resume=true"])
    expected = _tokens_loss(exported, _first_batch(cfg))
    assert run_sft(cfg)["losses"][0] == pytest.approx(expected, rel=1e-4)
