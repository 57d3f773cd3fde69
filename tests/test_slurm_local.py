"""The sbatch path for real: a local two-node Slurm (tests/slurm/local_cluster.sh), the tiny SFT
script submitted with sbatch, preempted with the batch shell's signal, requeued and resumed.

One job covers the whole path (CPU time is the budget): the job starts 2 ranks over nodes n1 and
n2, gets USR1 on its batch shell (what `--signal=B:USR1@...` sends before the time limit), and
must then save a checkpoint, call `scontrol requeue`, come back with Restarts=1, resume from that
checkpoint and finish with JobState=COMPLETED. `sbatch --wait` can return 0 for a job that never
ran, so the test reads the job state from `scontrol show job` (accounting is off: no sacct).

Runs wherever Slurm can run: as root, installing Debian's slurmctld/slurmd/slurm-client/munge when
missing (CI). Skipped only when that is impossible (not root, or apt refused the install).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _sft_helpers import train_tokenizer, write_dataset

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tests" / "slurm" / "local_cluster.sh"
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
STEPS = 40  # long enough that the signal lands mid-run, short enough for CI


def _have_slurm() -> bool:
    return all(shutil.which(b) for b in SLURM_BINARIES)


def _free_port_block(n: int) -> int:
    """First port of n consecutive free TCP ports on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no block of {n} free ports")


def _base_env() -> dict:
    """The test's environment without any enclosing launcher's placement (pytest itself may run
    inside a Slurm job or under torchrun)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a local Slurm (slurmd, munged) needs root")
    if not _have_slurm() and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    state = tmp_path_factory.mktemp("slurm")
    env = _base_env()
    env["MS_SLURM_BASE_PORT"] = str(_free_port_block(4))
    try:
        proc = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True,
                              env=env, timeout=900)
        if proc.returncode != 0 and not _have_slurm():
            pytest.skip(f"apt could not install Slurm: {proc.stderr[-500:]}")
        assert proc.returncode == 0, f"local Slurm did not start:\n{proc.stderr[-3000:]}\n{_logs(state)}"
        env["SLURM_CONF"] = str(state / "slurm.conf")
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=120)
        left = sorted(p.name for p in (state / "pids").glob("*.pid")) if (state / "pids").is_dir() else []
        assert not left, f"daemons left running: {left}"


def _logs(state: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((state / "log").glob("*.log")))


def _job(env: dict, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(env: dict, job_id: str, log: Path, until, what: str, timeout: float) -> dict:
    """Poll `scontrol show job` until `until(info)`; fail with the job log on timeout or a terminal
    state reached too early."""
    deadline = time.monotonic() + timeout
    while True:
        info = _job(env, job_id)
        if until(info):
            return info
        if info.get("JobState") in TERMINAL:
            pytest.fail(f"job {job_id} ended {info.get('JobState')} while waiting for {what}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} not {what} after {timeout:.0f}s (state {info.get('JobState')}):\n{_tail(log)}")
        time.sleep(0.5)


def _nodes_idle(env: dict) -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env,
                         timeout=30).stdout.split()
    return out == ["n1", "idle", "n2", "idle"]


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no job log)"


def _tensorboard_steps(tb_dir: Path) -> list[int]:
    """train/loss steps of every event file in write order (a run restarted from scratch would
    repeat steps; one that resumed continues them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        acc = EventAccumulator(str(f), purge_orphaned_data=False)
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")]
    return steps


def _job_env(cluster: dict, tmp_path: Path) -> dict:
    env = dict(cluster)
    env.update(MS_PYTHON=sys.executable, MS_LOG_DIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1",
               MS_MASTER_PORT=str(_free_port_block(1)))
    return env


def _submit(env: dict, script: str, log: Path, overrides: list[str]) -> str:
    """sbatch from the repo root (the job's working directory); returns the job id."""
    out = subprocess.run(["sbatch", "--parsable", f"--output={log}", script, *overrides], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _assert_ranks_logged(text: str, runs: int) -> None:
    """Every run placed rank 0 on n1 and rank 1 on n2 (srun's block distribution)."""
    assert text.count("[megatron-search] rank 0 of 2 on node n1") == runs, text[-4000:]
    assert text.count("[megatron-search] rank 1 of 2 on node n2") == runs, text[-4000:]


def test_sft_tiny_dry_run_without_slurm():
    """The tiny script plans 2 nodes x 1 rank from its config, like the big ones, with no Slurm around."""
    env = _base_env()
    env["MS_PYTHON"] = sys.executable
    out = subprocess.run(["bash", "slurm/sft_tiny.sh", "--dry-run", "sft.steps=5"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "training: 2 node(s) x 1 ranks = world 2; master node001" in out.stdout
    assert "SGLang engines: 0" in out.stdout
    assert "srun --nodes=2 --ntasks-per-node=1 megatron-search sft configs/tiny_sft_slurm.yaml sft.steps=5" in out.stdout


def test_sft_tiny_job_completes_after_preemption_and_requeue(cluster, tmp_path):
    env = _job_env(cluster, tmp_path)
    data = write_dataset(tmp_path / "sft.jsonl", range(8))
    tok = train_tokenizer(tmp_path)
    run = tmp_path / "run"
    log = tmp_path / "job.out"
    job = _submit(env, "slurm/sft_tiny.sh", log, [f"model.tokenizer={tok}", f"sft.datasets={{{data}: 1.0}}",
                                                 f"run.output_dir={run}", f"sft.steps={STEPS}",
                                                 "logging.progress_bars=true"])
    try:
        # The progress bar appears once training has installed its signal handler.
        _wait(env, job, log, lambda i: i.get("JobState") == "RUNNING" and "sft:" in _tail(log, 10**6),
              "training", 240)
        sig = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True,
                             timeout=30)
        assert sig.returncode == 0, sig.stderr
        # lib.sh's trap: training checkpoints and exits, then `scontrol requeue`.
        _wait(env, job, log, lambda i: int(i.get("Restarts", 0)) >= 1, "requeued", 180)
        # Slurm delays a requeued job's start (BeginTime, ~2 min) so its previous run can finish on the
        # nodes; once the job is pending and both nodes are idle again, let it start now.
        _wait(env, job, log, lambda i: i.get("JobState") == "PENDING" and _nodes_idle(env), "pending on idle nodes",
              120)
        time.sleep(2)  # margin: the previous run's step credentials were revoked moments ago
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True,
                       timeout=30)
        info = _wait(env, job, log, lambda i: i.get("JobState") in TERMINAL, "finished", 300)
    finally:
        if _job(env, job).get("JobState") not in TERMINAL:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    text = _tail(log, 10**7).replace("\r", "\n")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert info["Restarts"] == "1"

    _assert_ranks_logged(text, runs=2)
    assert "preemption signal: asking training to checkpoint, then requeueing job" in text
    saved = re.search(r"stop signal received: saved step (\d+), exiting", text)
    assert saved, text[-4000:]
    k = int(saved.group(1))
    assert 1 <= k < STEPS
    assert "restart 1: resuming from the latest checkpoint" in text

    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:08d}"
    for step in (k, STEPS):
        d = ckpt / f"step_{step:08d}"
        assert (d / "model_optim" / "metadata.json").is_file() and (d / "trainer.json").is_file()
        assert f'"iteration": {step},' in (d / "trainer.json").read_text()
    # One event file per run: steps 1..k, then k+1..STEPS (resumed, not restarted).
    assert _tensorboard_steps(run / "tensorboard") == list(range(1, STEPS + 1))


def test_grpo_tiny_job_completes(cluster, tmp_path):
    """GRPO through slurm/grpo_tiny.sh: rollouts on rank 0's CPU engine against the embedded search
    index, reward model scores, token-IS updates over EP=2 across n1 and n2; 2 steps and a checkpoint."""
    from _grpo_fixture import build

    fx = build(tmp_path / "world")
    env = _job_env(cluster, tmp_path)
    run = tmp_path / "run"
    log = tmp_path / "job.out"
    job = _submit(env, "slurm/grpo_tiny.sh", log, [*fx["common"], f"data.qa_path={fx['qa']}", "data.mix={qa: 1.0}",
                                                  f"rm.load={fx['rm']}", f"run.output_dir={run}"])
    try:
        info = _wait(env, job, log, lambda i: i.get("JobState") in TERMINAL, "finished", 400)
    finally:
        if _job(env, job).get("JobState") not in TERMINAL:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    text = _tail(log, 10**7)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    _assert_ranks_logged(text, runs=1)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    d = ckpt / "step_00000002"
    assert (d / "model_optim" / "metadata.json").is_file() and '"iteration": 2,' in (d / "trainer.json").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1]
    assert (run / "final_weights" / "model.safetensors").is_file()


def test_requeued_run_resumes_only_from_an_existing_checkpoint(tmp_path):
    """lib.sh's restart rule, without Slurm: a requeued job (SLURM_RESTART_COUNT > 0) gets
    checkpoint.resume=true when a complete checkpoint exists, a first run or an empty run dir not."""
    run = tmp_path / "run"
    script = ('source slurm/lib.sh; MS_CONFIG=configs/tiny_sft_slurm.yaml; MS_OVERRIDES=("$@"); '
              'echo "[$(ms_resume_override)]"')

    def resume(restarts: int, *overrides: str) -> str:
        env = _base_env()
        env.update(MS_PYTHON=sys.executable, SLURM_RESTART_COUNT=str(restarts))
        out = subprocess.run(["bash", "-c", script, "resume-test", f"run.output_dir={run}", *overrides], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert resume(1) == "[]"  # nothing saved yet: start fresh
    (run / "checkpoints" / "step_00000003.tmp-abc").mkdir(parents=True)  # an interrupted save does not count
    assert resume(1) == "[]"
    (run / "checkpoints" / "step_00000002").mkdir()
    assert resume(0) == "[]"  # first run
    assert resume(1) == "[checkpoint.resume=true]"
    assert resume(2, "checkpoint.resume=true") == "[]"  # already asked for


def test_engines_sharing_a_node_see_disjoint_gpus(cluster, tmp_path):
    """The GRPO plan's SGLang engines started by slurm/lib.sh under Slurm: 2 nodes x 2 GPUs (gres), one
    1-GPU engine per GPU. Each engine process (tests/slurm/probe records it) runs on its planned node,
    sees the node's GPUs as Slurm exposes them to a step, and its --base-gpu-id picks a GPU no other
    engine on that node uses; ports and sampling seeds differ per engine. Every engine got the job's API key
    from the environment: as SGLang's --api-key in memory, never on its command line, and not left in its
    environment; the key is in no log."""
    import hashlib
    import json
    import secrets

    env = _job_env(cluster, tmp_path)
    probe = tmp_path / "probe"
    probe.mkdir()
    key = secrets.token_urlsafe(32)
    env.update(MS_REPO=str(REPO), MS_PROBE_DIR=str(probe), MEGATRON_SEARCH_ENGINE_KEY=key)
    log = tmp_path / "job.out"
    job = _submit(env, "tests/slurm/engine_probe.sh", log, [
        "--tasks-per-node", "1", "rollout.engine=sglang", "rollout.sglang.tp=1", "cluster.gpus_per_node=2",
        "rollout.sglang.enable_memory_saver=true",
        # the launch plan checks what the GRPO job needs (config.stage_problems); the probe never reads them
        "rm.load=unused-rm", "data.qa_path=unused-qa", "data.rubric_path=unused-rubrics"])
    try:
        info = _wait(env, job, log, lambda i: i.get("JobState") in TERMINAL, "finished", 180)
    finally:
        if _job(env, job).get("JobState") not in TERMINAL:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_tail(log)}"
    records = [json.loads(p.read_text()) for p in sorted(probe.glob("engine_*.json"))]
    assert len(records) == 4, (sorted(p.name for p in probe.iterdir()), _tail(log))

    def arg(r, flag, default=None):
        return r["argv"][r["argv"].index(flag) + 1] if flag in r["argv"] else default

    by_node: dict[str, list] = {}
    for r in records:
        by_node.setdefault(r["env"]["SLURMD_NODENAME"], []).append(r)
    assert sorted(by_node) == ["n1", "n2"] and all(len(v) == 2 for v in by_node.values())
    for node, rs in by_node.items():
        gpus_used = []
        for r in rs:
            visible = r["env"]["CUDA_VISIBLE_DEVICES"].split(",")
            assert len(visible) == 2, (node, r["env"])  # the step sees both of the node's GPUs
            base, tp = int(arg(r, "--base-gpu-id", 0)), int(arg(r, "--tp-size"))
            assert base + tp <= len(visible), (node, r["argv"])
            gpus_used += visible[base:base + tp]
        assert sorted(gpus_used) == ["0", "1"], (node, gpus_used)  # disjoint, and every GPU serves
        assert len({arg(r, "--port") for r in rs}) == 2, node
    assert len({arg(r, "--random-seed") for r in records}) == 4
    want = hashlib.sha256(key.encode()).hexdigest()
    for r in records:
        assert r["api_key_sha256"] == want and arg(r, "--api-key") == want, r
        assert not r["api_key_in_cmdline"] and not r["api_key_in_environ"], r
    logs = [log, *sorted((tmp_path / "logs" / "sglang").glob("*.log"))]
    assert len(logs) == 5 and not any(key in p.read_text(errors="replace") for p in logs)
