"""SFT on 2 gloo processes: TP=2 with sequence parallel, EP=2 and PP=2 (1F1B), 2 steps each through
`run_sft` (Megatron DDP, optimizer, distributed checkpoint of the sharded state at the end).
Also: an EP=2 run resumed at EP=2 (bitwise), a TP=2 checkpoint (fully_reshardable) resumed at PP=2
(resharded), a PP=2 checkpoint in the default dp_reshardable format refused at TP=2, and an EP=2 checkpoint
refused at EP=1. One spawn runs every case in turn on one process group."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _sft_helpers import sft_config, train_tokenizer, write_dataset

pytestmark = pytest.mark.multiprocess

LAYOUTS = {
    # fully_reshardable: the format a checkpoint that changes layout is saved in (the default, dp_reshardable,
    # resumes at its own layout only)
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "sft.steps=4", "checkpoint.save_interval=2",
               "checkpoint.optimizer_format=fully_reshardable"],
    "ep2": ["parallel.ep=2", "sft.steps=4", "checkpoint.save_interval=2"],
    "pp2": ["parallel.pp=2"],
}
# Resume TP=2's step-2 checkpoint at PP=2 (weights and Adam state resharded) and train steps 3-4.
CROSS = ["parallel.pp=2", "sft.steps=4", "checkpoint.resume=true"]


def _worker(rank: int, world: int, port: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_search.distributed import DistEnv
    from megatron_search.train.sft import run_sft

    root = Path(root)
    data = {str(root / "data.jsonl"): 1.0}
    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    cross = [*CROSS, f"checkpoint.load={root / 'tp2_sp' / 'ckpt' / 'step_00000002'}"]
    same = ["parallel.ep=2", "sft.steps=4", "checkpoint.resume=true",
            f"checkpoint.load={root / 'ep2' / 'ckpt' / 'step_00000002'}"]
    for name, overrides in [*LAYOUTS.items(), ("pp2_from_tp2", cross), ("ep2_resumed", same)]:
        cfg = sft_config(root / name, data, overrides, world=world)
        held = {}

        def snapshot(trainer):
            held["trainer"] = trainer
            held["before"] = [p.detach().clone() for p in trainer.model[0].parameters()]

        summary = run_sft(cfg, env=env, on_start=snapshot)
        unchanged = [n for (n, p), b in zip(held["trainer"].model[0].named_parameters(), held["before"])
                     if torch.equal(b, p.detach())]
        results[name] = {"losses": summary["losses"], "grad_norms": summary["grad_norms"], "unchanged": unchanged,
                         "params": len(held["before"]), "checkpoint": summary["checkpoint"]}
    from megatron_search.trainer.checkpoint import CheckpointError

    def refusal(name: str, overrides: list[str]):
        try:
            run_sft(sft_config(root / name, data, overrides, world=world), env=env)
        except CheckpointError as e:
            return str(e)
        return None

    # EP=2 keeps expert parameters in a separate optimizer; EP=1 does not: a clear error, not a bad load.
    results["ep2_to_pp2_error"] = refusal("pp2_from_ep2", [*CROSS, f"checkpoint.load={root / 'ep2' / 'ckpt' / 'step_00000002'}"])
    # the default format keeps each DP rank's shard as it lies: another TP/PP layout is refused, naming the fix
    results["pp2_to_tp2_error"] = refusal("tp2_from_pp2", [
        "parallel.tp=2", "parallel.sequence_parallel=true", "sft.steps=4", "checkpoint.resume=true",
        f"checkpoint.load={root / 'pp2' / 'ckpt' / 'step_00000002'}"])
    (root / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _mp import run_spawned

    root = tmp_path_factory.mktemp("sft_parallel")
    write_dataset(root / "data.jsonl", range(6))
    for name in [*LAYOUTS, "pp2_from_tp2", "pp2_from_ep2", "ep2_resumed", "tp2_from_pp2"]:
        (root / name).mkdir()
        train_tokenizer(root / name)
    run_spawned(_worker, 2, str(root), timeout_s=300)
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_step_sft_on_two_processes(results, layout):
    root, ranks = results
    if layout == "tp2_sp":
        # TP rank 1 holds embedding rows 1024..2047; the 600-id test tokenizer never uses them, so that
        # shard gets no gradient (and Adam without weight decay leaves it alone): exactly that one stays.
        assert ranks[1][layout]["unchanged"] == ["embedding.word_embeddings.weight"]
        ranks[1][layout]["unchanged"] = []
    for r in ranks:
        got = r[layout]
        assert len(got["losses"]) == (2 if layout == "pp2" else 4) and all(math.isfinite(x) for x in got["losses"] + got["grad_norms"])
        assert abs(got["losses"][0] - math.log(2048)) < 1.0  # untrained model: ~uniform over the vocabulary
        assert got["params"] > 0
        assert got["unchanged"] == [], (layout, got["unchanged"])  # every local parameter (shard) was updated
    assert ranks[0][layout]["losses"] == ranks[1][layout]["losses"]  # global loss, identical on both ranks
    ckpt = Path(ranks[0][layout]["checkpoint"])
    assert ckpt.name == ("step_00000002" if layout == "pp2" else "step_00000004") and (ckpt / "model_optim" / "metadata.json").is_file()
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]


def test_checkpoint_reshards_across_layouts(results):
    """TP=2 checkpoint of step 2 resumed at PP=2: steps 3 and 4 give the losses the TP=2 run got (to
    float tolerance: reductions run in another order), so weights, Adam moments and the data
    position all carried over from TP shards into pipeline stages."""
    root, ranks = results
    for r in ranks:
        tp2, cross = r["tp2_sp"], r["pp2_from_tp2"]
        assert len(cross["losses"]) == 2
        assert cross["losses"] == pytest.approx(tp2["losses"][2:], rel=1e-4)
        assert cross["grad_norms"] == pytest.approx(tp2["grad_norms"][2:], rel=1e-4)
        assert tp2["losses"][3] != pytest.approx(tp2["losses"][2], rel=1e-3)  # the steps really differ


def test_optimizer_split_mismatch_is_a_clear_error(results):
    for r in results[1]:
        assert r["ep2_to_pp2_error"] is not None and "EP > 1 on both sides" in r["ep2_to_pp2_error"]


def test_a_dp_reshardable_checkpoint_at_another_layout_is_refused(results):
    for r in results[1]:
        error = r["pp2_to_tp2_error"]
        assert error is not None and "dp_reshardable" in error and "tp 1 -> 2" in error and "pp 2 -> 1" in error, error
        assert "checkpoint.optimizer_format=fully_reshardable" in error


def test_same_layout_resume_on_two_processes_is_bitwise(results):
    """EP=2 x DP=2, saved dp_reshardable (the default): each DP rank writes and reads its own shard of the
    distributed optimizer; steps 3-4 after the resume equal the uninterrupted run exactly."""
    for r in results[1]:
        assert r["ep2_resumed"]["losses"] == r["ep2"]["losses"][2:]
        assert r["ep2_resumed"]["grad_norms"] == r["ep2"]["grad_norms"][2:]
