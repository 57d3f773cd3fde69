"""GRPO end to end on CPU (gloo): rollouts through the agent loop on the in-process engine, the trained
reward model for s, token-IS updates, weight sync; at 1 process and at TP=2 (sequence parallel) / EP=2."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from _grpo_fixture import build

    return build(tmp_path_factory.mktemp("grpo_world"))


def scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    return [e.value for e in ea.Scalars(tag)] if tag in ea.Tags()["scalars"] else []


def weights_changed(run_dir: Path) -> bool:
    from safetensors.torch import load_file

    before = load_file(run_dir / "reference_weights" / "model.safetensors")
    after = load_file(run_dir / "final_weights" / "model.safetensors")
    assert before.keys() == after.keys()
    return any(not torch.equal(before[k], after[k]) for k in before)


def check_run(run_dir: Path, steps: int) -> None:
    losses = scalars(run_dir, "train/loss")
    assert losses and all(math.isfinite(x) for x in losses)
    assert len(scalars(run_dir, "reward/mean")) == steps
    # the engine scored its samples with the weights the trainer had: tiny train-inference mismatch
    assert all(abs(k) < 1e-3 for k in scalars(run_dir, "train/mismatch_kl_k3"))
    assert weights_changed(run_dir)
    # no engine went down: nothing probed or generated on an engine whose memory was released (SGLang's /health
    # generates one token; the probe before a push is /ready)
    assert scalars(run_dir, "engine/restarts_total") and not any(scalars(run_dir, "engine/restarts_total"))
    for tag in ("reward/r_base", "reward/preference", "reward/pen_tool", "reward/pen_len", "rollout/tool_calls",
                "rollout/effective_calls", "rollout/broken_calls", "rollout/search_timeouts", "rollout/search_errors",
                "rollout/response_tokens", "advantage/std",
                "train/is_weight_mean", "train/grad_norm", "train/lr", "time/rollout_s", "time/train_s",
                "time/weight_sync_s", "perf/rollouts_per_s", "train/zero_signal_groups", "train/filtered_groups"):
        assert scalars(run_dir, tag), tag
    check_colocated_cycle(run_dir, steps)


def check_colocated_cycle(run_dir: Path, steps: int) -> None:
    """rollout.mode=colocated (the default): per step the trainer leaves during rollouts, the engine frees its
    weights and KV cache while the policy trains, and its weights return (then are pushed) before generation."""
    import json

    rows = [json.loads(line) for line in (run_dir / "colocate_phases.jsonl").read_text().splitlines()]
    trained = 0
    for step in range(steps):
        phases = [r for r in rows if r["step"] == step]
        names = [r["phase"] for r in phases]
        assert names in (["rollout", "scoring", "train", "sync", "resumed"], ["rollout", "scoring", "sync", "resumed"]), names
        by = {r["phase"]: r for r in phases}
        assert by["rollout"]["trainer_bytes"] == 0 and by["rollout"]["engine_weights_bytes"][0] > 0
        # at the push only the parameters are resident (grads and optimizer state left before the engine's
        # weights came back); at the rollout phase nothing is
        assert 0 < by["sync"]["trainer_bytes"] < by.get("train", {"trainer_bytes": float("inf")})["trainer_bytes"]
        assert by["sync"]["engine_weights_bytes"][0] > 0
        assert by["scoring"]["engine_weights_bytes"] == [0] and by["scoring"]["engine_kv_cache_bytes"] == [0]
        assert by["scoring"]["trainer_bytes"] == 0
        # the reward model is resident only while it scores
        assert by["scoring"]["reward_model_bytes"] > 0
        assert all(by[p]["reward_model_bytes"] == 0 for p in by if p != "scoring"), by
        if "train" in by:
            trained += 1
            assert by["train"]["engine_weights_bytes"] == [0] and by["train"]["engine_kv_cache_bytes"] == [0]
            assert by["train"]["trainer_bytes"] > 0
    assert trained >= 1
    from test_residency import check_ledger

    check_ledger(run_dir, trained=True, saved=any((run_dir / "checkpoints").glob("step_*")))
    assert scalars(run_dir, "time/offload_s") and scalars(run_dir, "time/release_s") and scalars(run_dir, "time/resume_s")


@pytest.mark.e2e
def test_grpo_two_steps_one_process(fx, tmp_path):
    from _grpo_fixture import grpo_worker
    from _mp import run_spawned

    # checkpoints after every step: the colocated cycle must bring the optimizer state back before a save
    layouts = [("single", ["grpo.routing_agreement=true", "checkpoint.save_interval=1", "grpo.eval_interval=2",
                           "grpo.eval_prompts=3"]),
               ("replay", ["grpo.routing_replay=true"]),
               ("refs_on_rollout", ["grpo.reference_source=rollout_engines"])]
    run_spawned(grpo_worker, 1, layouts, fx, str(tmp_path))
    # reference answers from the rollout engines: every prompt of the run (2 steps x 2 prompts) answered at
    # step 0, before the first update, G = 2 times each (rollout k of a group is compared with sample k);
    # no rank-0 reference engine, no reference checkpoint
    refs = tmp_path / "refs_on_rollout"
    pre = scalars(refs, "references/pregenerated")
    cached = [json.loads(line) for line in (refs / "reference_answers.jsonl").read_text().splitlines()]
    assert pre and 2 <= pre[0] == len(cached) <= 8, (pre, len(cached))
    per_prompt: dict = {}
    for r in cached:
        per_prompt.setdefault(r["key"], set()).add(r["sample"])
    assert all(samples == {0, 1} for samples in per_prompt.values()), per_prompt
    assert len(scalars(refs, "reward/mean")) == 2 and not (refs / "reference_weights").exists()
    check_run(tmp_path / "single", 2)
    # held-out evaluation every 2 steps (and after the last): step index 1 only, 3 test-split prompts
    acc, calls = scalars(tmp_path / "single", "eval/accuracy"), scalars(tmp_path / "single", "eval/effective_calls")
    assert len(acc) == len(calls) == 1 and min(abs(acc[0] - k / 3) for k in range(4)) < 1e-6 and calls[0] >= 0
    saved = sorted(p.name for p in (tmp_path / "single" / "checkpoints").glob("step_*"))
    assert saved and saved[-1] == "step_00000002", saved
    # replay off: the agreement between training's and the engine's experts is measured, not forced
    natural = scalars(tmp_path / "single", "train/routing_agreement")
    assert natural and all(0.0 <= a <= 1.0 for a in natural)
    # routing replay: the engine returns each token's experts and training routes exactly there
    check_run(tmp_path / "replay", 2)
    # a checkpoint after the last step although save_interval (the default) does not divide grpo.steps
    final = sorted(p.name for p in (tmp_path / "replay" / "checkpoints").glob("step_*"))
    assert final == ["step_00000002"], final
    forced = scalars(tmp_path / "replay", "train/routing_agreement")
    assert forced and all(a == 1.0 for a in forced)


@pytest.mark.e2e
def test_grpo_two_steps_tp2_and_ep2(fx, tmp_path):
    from _grpo_fixture import grpo_worker
    from _mp import run_spawned

    layouts = [("tp2", ["parallel.tp=2", "parallel.sequence_parallel=true"]), ("ep2", ["parallel.ep=2"])]
    run_spawned(grpo_worker, 2, layouts, fx, str(tmp_path))
    for name, _ in layouts:
        check_run(tmp_path / name, 2)
    # The batch reaches each data-parallel replica as its slice only: EP=2 keeps DP=2 (each rank gets half),
    # TP=2 has DP=1 (both ranks of the one replica need all of it).
    for name, share in (("ep2", 0.5), ("tp2", 1.0)):
        total, received = scalars(tmp_path / name, "batch/total_MB"), scalars(tmp_path / name, "batch/max_rank_received_MB")
        assert total and len(total) == len(received)
        for t, r in zip(total, received):
            assert r == pytest.approx(share * t, rel=1e-9), (name, t, r)


def test_greedy_rollouts_are_refused():
    """rollout.temperature=0 would make every rollout of a group the same: the GRPO job refuses it at start-up,
    before the process group or the model exists (config.stage_problems; loading for the stage refuses it too)."""
    from megatron_search.config import load_config
    from megatron_search.distributed import LayoutError
    from megatron_search.train.grpo import run_grpo

    cfg = load_config(None, ["rollout.temperature=0"])
    with pytest.raises(LayoutError, match=r"rollout\.temperature: 0 samples greedily"):
        run_grpo(cfg)


def test_served_weights_check_stops_on_a_mismatch():
    """grpo.max_mismatch_kl: the first update's (or the check-only pass's) mismatch KL over the limit stops the run
    naming both figures; at or under it, or with the limit off, nothing happens."""
    from types import SimpleNamespace

    from megatron_search.config import load_config
    from megatron_search.train.grpo_run import GRPORun

    on = SimpleNamespace(cfg=load_config(None, ["grpo.max_mismatch_kl=1e-6"]))
    with pytest.raises(RuntimeError, match=r"mismatch KL 0.00131 > grpo.max_mismatch_kl 1e-06"):
        GRPORun._check_served_weights(on, 3, {"mismatch_kl_k3": 1.31e-3})
    GRPORun._check_served_weights(on, 3, {"mismatch_kl_k3": 1e-6})
    GRPORun._check_served_weights(on, 3, {})  # a step whose micro-batches report no mismatch (no trained token)
    off = SimpleNamespace(cfg=load_config(None, []))
    assert off.cfg.grpo.max_mismatch_kl is None
    GRPORun._check_served_weights(off, 3, {"mismatch_kl_k3": 10.0})


def _hf_tensors(folder: Path) -> dict:
    from megatron_search.weights.hf_source import HFTensorSource

    src = HFTensorSource.from_dir(folder)
    return {n: src.get(n) for n in src.names()}


@pytest.mark.e2e
def test_grpo_from_an_sft_run_of_an_hf_directory_and_the_final_export(fx, tmp_path):
    """The real-model workflow: an HF directory -> SFT from its weights -> `convert mcore-to-hf` of the SFT run ->
    GRPO from the SFT run with the engines started from that export -> a final export that transformers loads and
    that holds the trainer's weights (a forward of the trainer's last checkpoint gives transformers' loss on it)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from _grpo_fixture import TINY, grpo_worker
    from _mp import run_spawned
    from _sft_helpers import write_dataset
    from megatron_search.config import load_config
    from megatron_search.train.sft import build_batcher, run_sft
    from megatron_search.weights.convert import convert

    hf = tmp_path / "hf"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), dtype=torch.float32).save_pretrained(str(hf))
    tokenizer = Path(fx["qa"]).parent / "tokenizer.json"
    shutil.copy(tokenizer, hf / "tokenizer.json")
    data = write_dataset(tmp_path / "sft.jsonl", range(8))

    def sft(name: str, start: list[str]):
        return load_config("configs/tiny_cpu.yaml", [
            f"sft.datasets={{{data}: 1.0}}", "sft.seq_length=256", "sft.global_batch_size=4", "sft.micro_batch_size=4",
            "sft.steps=2", "optim.lr=1e-3", f"run.output_dir={tmp_path / name}",
            f"checkpoint.dir={tmp_path / name / 'ckpt'}", "logging.progress_bars=false", "model.hf_config=",
            "model.init=pretrained", *start], stage="sft")

    sft_run = run_sft(sft("sft", [f"model.path={hf}"]))
    exported = tmp_path / "sft_hf"
    convert("mcore_to_hf", tmp_path / "sft" / "ckpt", exported, progress=False)  # the run's root: its latest step
    assert (exported / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    sft_weights, pretrained = _hf_tensors(exported), _hf_tensors(hf)
    assert sft_weights.keys() == pretrained.keys()
    assert any(not torch.equal(sft_weights[n], pretrained[n]) for n in pretrained)  # SFT moved them
    assert sft_run["checkpoint"].endswith("step_00000002")

    start = ["model.init=pretrained", f"model.path={exported}", "model.hf_config=", "model.tokenizer=",
             f"checkpoint.load={tmp_path / 'sft' / 'ckpt'}", "checkpoint.save_interval=2"]
    run_spawned(grpo_worker, 1, [("grpo", start)], fx, str(tmp_path))
    run = tmp_path / "grpo"
    served = load_config(str(run / "engines" / "rollout_engine_config.yaml"))  # what the engine process was given
    assert served.rollout.local.model_path is None and served.model.engine_dir() == exported
    # the policy GRPO started from is the SFT run's, tensor for tensor
    start_weights = _hf_tensors(run / "reference_weights")
    assert start_weights.keys() == sft_weights.keys()
    assert all(torch.equal(start_weights[n], sft_weights[n]) for n in sft_weights)
    check_run(run, 2)

    final = run / "final_weights"
    tok = AutoTokenizer.from_pretrained(str(final))
    assert tok.encode("When was Quessa founded?") == AutoTokenizer.from_pretrained(str(hf)).encode(
        "When was Quessa founded?")
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    cfg = sft("from_grpo", [f"model.path={final}", f"checkpoint.load={run / 'checkpoints'}", "sft.steps=1"])
    batch = build_batcher(cfg).next_batch()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens).logits.double()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    mask = batch.loss_mask.flatten().double()
    expected = float((ce * mask).sum() / mask.sum())
    assert run_sft(cfg)["losses"][0] == pytest.approx(expected, rel=1e-5)
