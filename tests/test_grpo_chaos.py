"""Chaos (issue 25.3): a CPU GRPO run with 2 local engine servers; one is SIGKILLed in the middle of a step, twice.

The parent process watches the run: once the previous step's rollouts are logged, it waits until the
victim engine's cache is flushed by the weight update (/local/memory) and then holds requests again
(the step's rollouts run there), finds its process by its port file and SIGKILLs it, at step 1 and
again at step 2, with
rollout.health.max_restarts=1. Then, from what the run left behind:
- step 1's kill: the rollouts in flight there ran again on the other engine, none lost; the engine
  was restarted once, at the same URL, and after that weight update both engines' weights equal the
  trainer's export (sha256 per parameter, read by the run after every update), version included;
  it served step 2;
- step 2's kill: no restart left, the engine stays down, the update reaches the live one only;
  step 3 runs on one engine, is over rollout.health.max_lost_capacity (half the engines gone) and
  stops the run with LostCapacityError and a checkpoint of step 3's start;
- every step's jobs are in rollout_dispatch.jsonl exactly once with distinct seeds, and TensorBoard's
  rollout/count + rollout/lost = jobs, rollout/retried = attempts that moved, engine counts per step.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS, G = 4, 4
RUN = ["rollout.num_engines=2", f"grpo.prompts_per_step={PROMPTS}", f"grpo.group_size={G}",
       "rollout.max_new_tokens=128", "rollout.max_turns=1", "rollout.health.heartbeat_interval_s=0.5",
       "rollout.health.max_restarts=1"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from _grpo_fixture import build

    return build(tmp_path_factory.mktemp("chaos_world"))


@pytest.fixture(autouse=True)
def job_key(monkeypatch):
    """The job's engine key, set here so this process can read the engines the spawned run starts."""
    monkeypatch.setenv("MEGATRON_SEARCH_ENGINE_KEY", secrets.token_urlsafe(32))


class Killer(threading.Thread):
    """SIGKILLs local engine `engine` of the run in `out` once each of `steps`' rollouts are running on it."""

    def __init__(self, out: Path, engine: int, steps: list[int], timeout_s: float = 400.0):
        super().__init__(daemon=True)
        self.out, self.engine, self.steps = out, engine, steps
        self.port_file = out / "engines" / f"local_engine_{engine}.log.port"
        self.deadline = time.monotonic() + timeout_s
        self.killed: list[dict] = []

    def run(self) -> None:
        for step in self.steps:
            while not self._step_done(step - 1):  # its dispatch rows are written once its rollouts are in
                self._tick(0.02, step)
            url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
            # until the weight update before `step` reached the engine (version `step`; a restarted engine's own
            # start-up health probe generates a token, as SGLang's does, and must not pass for step's requests)
            while self._weight_version(url) != str(step) or self._held_kv_bytes(url) != 0:
                self._tick(0.005, step)
            while self._held_kv_bytes(url) <= 0:  # then step `step`'s requests run there
                self._tick(0.005, step)
            pid = self._server_pid()
            os.kill(pid, signal.SIGKILL)
            self.killed.append({"step": step, "pid": pid, "url": url})

    def _tick(self, s: float, step: int) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"step {step}'s rollouts never ran on engine {self.engine}")
        time.sleep(s)

    def _step_done(self, step: int) -> bool:
        log = self.out / "rollout_dispatch.jsonl"
        return log.is_file() and any(json.loads(line)["step"] == step for line in log.read_text().splitlines()
                                     if line.endswith("}"))

    @staticmethod
    def _held_kv_bytes(url: str) -> int:
        """The engine's cache bytes (running batch + prefix cache); -1 while it does not answer (restarting)."""
        import urllib.error
        import urllib.request

        from megatron_search.rollout.engine.auth import bearer_header, key_from_env

        req = urllib.request.Request(f"{url}/local/memory", headers=bearer_header(key_from_env()))
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(json.loads(r.read())["kv_cache"])
        except (urllib.error.URLError, ConnectionError):
            return -1

    @staticmethod
    def _weight_version(url: str):
        import urllib.error
        import urllib.request

        from megatron_search.rollout.engine.auth import bearer_header, key_from_env

        req = urllib.request.Request(f"{url}/get_weight_version", headers=bearer_header(key_from_env()))
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return None
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return body.strip()
        return value.get("weight_version") if isinstance(value, dict) else str(value)

    def _server_pid(self) -> int:
        mark = str(self.port_file).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"megatron_search.rollout.local.server" in argv and mark in argv:
                return int(proc.name)
        raise RuntimeError(f"no local engine server process with {self.port_file}")


def dispatch_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollout_dispatch.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_engine_killed_mid_step_is_restarted_resynced_and_then_the_lost_capacity_limit_stops_the_run(fx, tmp_path,
                                                                                                     capsys, mode):
    import _chaos_worker
    from _grpo_fixture import grpo_overrides
    from _mp import run_spawned
    from test_train_grpo import scalars

    from megatron_search.config import load_config
    from megatron_search.train.grpo_data import build_mix_sampler

    out, steps, jobs = tmp_path / "chaos", 4, PROMPTS * G
    killer = Killer(out, engine=1, steps=[1, 2])
    killer.start()
    t0 = time.monotonic()
    run = RUN + [f"rollout.mode={mode}"]  # colocated: tensor sync, memory turns; disaggregated: broadcast groups
    run_spawned(_chaos_worker.main, 1, fx, str(out), steps, run, timeout_s=600)
    elapsed = time.monotonic() - t0
    killer.join(timeout=1)
    assert [k["step"] for k in killer.killed] == [1, 2] and killer.killed[0]["pid"] != killer.killed[1]["pid"]
    result = json.loads((out / "chaos_result.json").read_text())

    # every step's jobs once each, distinct seeds; attempts moved from engine 1 to engine 0 only at the kills
    rows = dispatch_rows(out)
    for step in range(steps):
        mine = [r for r in rows if r["step"] == step]
        assert sorted(r["job"] for r in mine) == list(range(jobs)) and len({r["seed"] for r in mine}) == jobs, step
        assert all(len(set(r["engines"])) == len(r["engines"]) and ("error" in r) == r["lost"] for r in mine), step
        count, lost = scalars(out, "rollout/count")[step], scalars(out, "rollout/lost")[step]
        assert count + lost == jobs and lost == sum(r["lost"] for r in mine) == 0, step
        assert scalars(out, "rollout/retried")[step] == sum(len(r["engines"]) - 1 for r in mine), step
    moved = [r for r in rows if len(r["engines"]) > 1]
    assert moved and all(r["engines"] == [1, 0] for r in moved) and {r["step"] for r in moved} == {1, 2}
    # the restarted engine served step 2: its rollouts went there first (and were running when it was killed again)
    assert sum(r["engines"][0] == 1 for r in rows if r["step"] == 2) == jobs // 2
    assert all(r["engines"] == [0] for r in rows if r["step"] == 3)  # no restart left: engine 1 stayed down
    assert scalars(out, "engine/marked_down") == [0.0, 1.0, 1.0, 0.0]
    assert scalars(out, "engine/restarts") == [0.0, 1.0, 0.0, 0.0]
    assert scalars(out, "engine/unrecovered") == [0.0, 0.0, 1.0, 1.0]
    assert scalars(out, "rollout/lost_capacity")[-1] == 0.5
    log = (out / "engines" / "local_engine_1.log").read_text()
    assert log.count(f"local engine serving {killer.killed[0]['url']}") == 2  # started, restarted at the same URL

    # after every weight update each serving engine holds the trainer's export, bitwise, at its version
    pushes = result["pushes"]
    assert [p["step"] for p in pushes] == [None, 0, 1, 2] and [p["version"] for p in pushes] == ["0", "1", "2", "3"]
    assert [p["state"] for p in pushes] == [["up", "up"]] * 3 + [["up", "down"]]
    for p in pushes:
        for i, digest in enumerate(p["engines"]):
            if digest is None:
                continue
            assert digest["weight_version"] == p["version"], (p["step"], i)
            assert digest["sha256"].keys() == p["trainer"].keys()
            assert [k for k in digest["sha256"] if digest["sha256"][k] != p["trainer"][k]] == [], (p["step"], i)
    assert pushes[2]["engines"][1] is not None  # the restarted engine, checked right after its re-sync

    # the limit: step 3 stopped before training, with a checkpoint of its start
    assert result["finished"] is False
    if mode == "colocated":  # the restarted engine's memory, and the lost-capacity save, in the priced order
        from test_residency import check_ledger

        check_ledger(out, trained=True, saved=True)
        assert "push: engine restarted" in (out / "residency.jsonl").read_text()
    else:  # disaggregated: the engines have GPUs of their own; the training GPU's moments hold only the trainer's
        from megatron_search.plan.residency import read_ledger

        from megatron_search.plan.residency import price
        from test_residency import CONFIGS, _sizes

        moments = read_ledger(out / "residency.jsonl")
        assert {"start: trainer built", "push", "train", "checkpoint save"} <= {m.name for m in moments}
        assert not any(h.startswith("engine.") for m in moments for h in m.holders)
        for path in CONFIGS:  # priced at the real sizes: the trainer and the resident reward model fit
            sizes, usable = _sizes(path)
            assert max(m.total for m in price(moments, sizes)) <= usable, path
    err = result["error"]
    assert "GRPO step 3: lost capacity over rollout.health.max_lost_capacity=0.25: 0 of 16 rollouts lost" in err
    assert "1 of 2 engines down after recovery (engine 1: " in err and "step_00000003" in err
    assert len(scalars(out, "reward/mean")) == 3 and not (out / "final_weights").exists()
    meta = json.loads((out / "checkpoints" / "step_00000003" / "trainer.json").read_text())
    sampler = build_mix_sampler(load_config(None, grpo_overrides(fx, out, steps) + run).data)
    for _ in range(3):
        sampler.take(PROMPTS)
    assert meta["iteration"] == 3 and meta["extra"]["sampler"] == json.loads(json.dumps(sampler.state_dict()))
    with capsys.disabled():
        print(f"\nchaos ({mode}): run {elapsed:.1f} s; retried {len(moved)} rollouts "
              f"({[sum(len(r['engines']) - 1 for r in rows if r['step'] == s) for s in range(steps)]} per step), "
              f"0 lost, 1 restart, stopped at step 3 with half the engines down")
