#!/usr/bin/env python
"""The `train` check of tools/gpu_selfcheck.py: SFT then GRPO of both tiny models on the device, equal to
the same run on CPU, plus HF <-> Megatron conversion and every weight-delivery path into the local engine.

Why: the models check runs one forward and backward; this one runs the stack's own entry points
(`run_sft`, `run_grpo`, `mcore_to_hf` / `hf_to_mcore`, `WeightSync`) where they meet CUDA: NCCL at
world size 1, Megatron's optimizer and schedule, the local engine serving rollouts on the GPU and
taking weight updates there.

Two child processes (`python tools/selfcheck_train.py --side ...`), work in a temporary folder:
  reference  CUDA hidden: CPU and gloo. First it builds what both sides share: a synthetic world with
             its search index and QA records, SFT data (one-hop trajectories with real search_web
             calls, and the same questions answered with nothing: see below), a BPE tokenizer, and a
             1-step reward model per architecture (GRPO's reward needs one). Then `sft` and `grpo`.
  device     started once those exist; the GPU (CPU too under --cpu-dry-run). Per architecture
             (configs/models/tiny_qwen3_moe, chat style qwen3; tiny_qwen3_5_moe, qwen3_5):
    sft       run_sft: 2 steps from a seeded transformers initialisation saved by the reference child (the
              same weights on both sides: Megatron's own init draws from the device's RNG), final checkpoint saved.
    convert   that checkpoint -> HF (mcore_to_hf): transformers' logits from the HF folder against
              Megatron's from the checkpoint, on the device; HF -> Megatron -> HF gives every tensor
              back bit for bit.
    delivery  a local engine server on the device; per mode (tensor, distributed, disk) the weights
              change and WeightSync pushes them: the engine's sha256 per parameter equals an HF model
              filled from the exporter, its version the pushed one; then its greedy tokens equal
              transformers' argmax decoding on those weights. One GPU: NCCL refuses two ranks on one
              device, so the distributed mode's broadcast group is gloo (staged through the host).
    grpo      run_grpo: 2 steps from the SFT checkpoint; rollouts through the search agent on a local
              engine server on the side's device (which also answers the reference prompts), the
              reward model on the trainer's device, colocated tensor sync, final policy as HF files.
The parent compares the device side with the reference step by step.

Tolerances (fp32 on both sides; TF32 off in matmuls and cuDNN convs, in the trainer and the engine):
  first SFT step (same initial weights, only the summation order differs): loss and grad norm 1e-4
  relative; later steps 1e-3 (an MoE router near-tie may route a token differently). GRPO losses sit
  near 0 (centred advantages): |a - b| / max(1, |b|) <= 1e-3. Rewards 1e-4 (the RM's score rounds
  differently), response lengths exactly (sampling runs on the host with the same seeds, so the same
  tokens come out), final policy ||W_dev - W_cpu|| / ||W_cpu|| <= 1e-4, mismatch k3 (engine vs
  trainer logprobs on one side) below 1e-3 as in tests/test_train_grpo.py, logits vs transformers 1e-4
  of their size as in the models check; sha256, round-trip tensors, versions and greedy tokens exact.
  Two CPU runs (one thread each) agree bit for bit in SFT and to ~1e-7 in GRPO, where the engine's
  logprobs depend on how its decode batches formed (timing); with 2 threads each, reductions change
  order and the GRPO figures drift to 5e-5 (grad norm) and 5e-6 (weights).
Settings that make 2 steps mean something: the SFT LR is high (5e-2) and half its mix is the empty
answer, so the stop token leaves 1/2048 and GRPO's rollouts differ in length (a near-uniform policy
runs every rollout to max_new_tokens: equal rewards, no update). Adam's eps is 1e-5, not 1e-8: its
first steps are about lr * g / (|g| + eps), which would turn a rounding-level gradient component into
a whole lr-sized step of either sign. A GRPO step updates only when some group's rewards differ; each
side must update on the same steps, at least once.
fla is hidden from both children (sys.modules["fla"] = None through their sitecustomize): its chunk
backward is refused on Hopper with Triton < 3.7.1, and its TF32 dots would swamp this comparison;
the gdn and models checks cover it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHS = {"tiny_qwen3_moe": "qwen3", "tiny_qwen3_5_moe": "qwen3_5"}  # model folder -> chat style
SFT_STEPS = GRPO_STEPS = 2
SFT_LR, GRPO_LR, ADAM_EPS = 5e-2, 1e-3, 1e-5  # see the module docstring
MODES = ("tensor", "distributed", "disk")
TOL_FIRST, TOL_LATER, TOL_REWARD, TOL_WEIGHTS, TOL_K3, TOL_LOGITS = 1e-4, 1e-3, 1e-4, 1e-4, 1e-3, 1e-4
GREEDY_PROMPT, GREEDY_TOKENS = [5, 17, 300, 42, 7, 999, 64, 128, 3, 11], 8
GRPO_TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "reward": "reward/mean",
             "response_tokens": "rollout/response_tokens", "mismatch_k3": "train/mismatch_kl_k3",
             "zero_signal_groups": "train/zero_signal_groups"}


# ---- inputs both sides share (built by the reference child) ----------------------------------------

def prepare(work: Path) -> dict:
    """World, index, QA, SFT data, tokenizer, one reward model per architecture; returns their paths."""
    from megatron_search.cli import main as cli
    from megatron_search.config import load_config
    from megatron_search.data.demo_tasks import one_hop_records, one_hop_sft_examples
    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.world import build_world
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer
    from megatron_search.search.local import build_index
    from megatron_search.search.tool import SearchTool

    world = build_world(seed=5, num_entities=40, filler_docs=6)
    docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
    build_index(docs, work / "index", progress=False)
    records = one_hop_records(world)
    write_jsonl(work / "qa.jsonl", [r.to_dict() for r in records])
    search = ["search.max_results=2", "search.snippet_chars=120", f"search.index_dir={work / 'index'}"]
    examples, _ = one_hop_sft_examples(records[:16], SearchTool.from_config(load_config(None, search).search))
    rows = [e.to_dict() for e in examples]
    write_jsonl(work / "sft_search.jsonl", rows)
    # the same questions answered with nothing (why: the module docstring); the mix alternates the two sets
    write_jsonl(work / "sft_empty.jsonl", [dict(r, id=f"{r['id']}-empty", messages=[
        *r["messages"][:2], {"role": "assistant", "content": ""}]) for r in rows])
    texts = [d["text"] for d in docs] + [ChatFormat(style).render(e.messages, e.tools)
                                         for e in examples for style in sorted(set(ARCHS.values()))]
    BPETokenizer.train(texts, vocab_size=1024).save(work / "tokenizer.json")
    inputs = {"search": search, "tokenizer": str(work / "tokenizer.json"), "qa": str(work / "qa.jsonl"),
              "sft": {str(work / "sft_search.jsonl"): 0.5, str(work / "sft_empty.jsonl"): 0.5}, "rm": {}}
    inputs["init"] = {}
    for arch in ARCHS:  # the SFT's initial weights, one file for both sides: Megatron's own random init draws from
        inputs["init"][arch] = str(_initial_weights(arch, work / f"init_{arch}"))  # the device's RNG
    for arch in ARCHS:
        out = work / f"rm_{arch}"
        code = cli(["rm", "train", *_common(arch, inputs), f"run.output_dir={out}", "rm.steps=1",
                    "rm.global_batch_pairs=2", "rm.micro_batch_pairs=2", "rm.max_length=96", "--demo", "4"])
        if code != 0:
            raise RuntimeError(f"rm train for {arch} exited with {code}")
        inputs["rm"][arch] = str(out / "checkpoints")
    tmp = work / "inputs.json.tmp"
    tmp.write_text(json.dumps(inputs))
    os.replace(tmp, work / "inputs.json")  # its appearance starts the device child
    return inputs


def _initial_weights(arch: str, out: Path) -> Path:
    """A seeded transformers model of `arch` (its own initialisation, float32) saved as an HF folder."""
    import torch
    import transformers

    model_dir = REPO / "configs/models" / arch
    cls = getattr(transformers, json.loads((model_dir / "config.json").read_text())["architectures"][0])
    torch.manual_seed(11)
    cls(transformers.AutoConfig.from_pretrained(model_dir)).float().save_pretrained(out)
    return out


def _engine_args(arch: str, inputs: dict) -> list[str]:
    """Config overrides of a local engine server for `arch` (weights come from the first push)."""
    return [f"model.hf_config={REPO / 'configs/models' / arch}", f"model.tokenizer={inputs['tokenizer']}",
            f"model.chat_style={ARCHS[arch]}", "model.params_dtype=float32"]


def _common(arch: str, inputs: dict) -> list[str]:
    return [*_engine_args(arch, inputs), "model.init=random", "parallel.backend=auto", f"optim.adam_eps={ADAM_EPS}",
            "logging.progress_bars=false", *inputs["search"]]


# ---- one side: sft, (convert, delivery,) grpo per architecture -------------------------------------

def run_side(work: Path, side: str, inputs: dict, archs) -> dict:
    """Every stage of `side` for each architecture; a failed stage records its traceback (after a failed
    sft the architecture's other stages are skipped: they start from its checkpoint)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # cuDNN: the GDN conv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "archs": {}}
    stages = ("sft", "convert", "delivery", "grpo") if side == "device" else ("sft", "grpo")
    for arch in archs:
        res = out["archs"][arch] = {}
        d = work / side / arch
        for stage in stages:
            t0 = time.perf_counter()
            try:
                if stage == "sft":
                    res[stage] = _sft(arch, inputs, d)
                    continue_from = Path(res[stage]["checkpoint"])
                elif stage == "convert":
                    res[stage] = _convert(arch, inputs, continue_from, d / "convert")
                elif stage == "delivery":
                    res[stage] = _delivery(arch, inputs, continue_from, d / "delivery", device)
                else:
                    res[stage] = _grpo(arch, inputs, continue_from, d / "grpo", device)
            except Exception as e:  # noqa: BLE001 - reported by the parent; the other stages still run
                res[stage] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
            res[stage]["seconds"] = time.perf_counter() - t0
            print(f"[{side}] {arch}.{stage}: {res[stage]['seconds']:.1f} s", flush=True)
            if stage == "sft" and "error" in res[stage]:
                break
    return out


def _sft(arch: str, inputs: dict, d: Path) -> dict:
    from megatron_search.config import load_config
    from megatron_search.train.sft import run_sft

    mix = "{" + ", ".join(f"{path}: {w}" for path, w in inputs["sft"].items()) + "}"
    common = [o for o in _common(arch, inputs) if o != "model.init=random"] + [f"model.path={inputs['init'][arch]}"]
    cfg = load_config(None, [*common, f"sft.datasets={mix}", "sft.seq_length=768",
                             "sft.packing=false", "sft.global_batch_size=2", "sft.micro_batch_size=1",
                             f"sft.steps={SFT_STEPS}", f"optim.lr={SFT_LR}", f"run.output_dir={d / 'sft'}",
                             f"checkpoint.dir={d / 'sft_ckpt'}", "checkpoint.save_interval=1000",
                             "logging.tensorboard=false"])
    tokens = []
    summary = run_sft(cfg, on_step=lambda it, m: tokens.append(m["tokens"]))
    return {"loss": summary["losses"], "grad_norm": summary["grad_norms"], "tokens": tokens,
            "checkpoint": summary["checkpoint"]}


def _init(arch: str, inputs: dict):
    from megatron_search.config import load_config
    from megatron_search.distributed import init_distributed

    cfg = load_config(None, _common(arch, inputs))
    return cfg, init_distributed(cfg)


def _convert(arch: str, inputs: dict, ckpt: Path, d: Path) -> dict:
    """SFT checkpoint -> HF: logits vs transformers; HF -> Megatron -> HF: bit for bit."""
    import torch

    from megatron_search.rollout.local.runner import load_hf_model
    from megatron_search.weights.checkpoint import hf_to_mcore, load_mcore_checkpoint, mcore_to_hf
    from megatron_search.weights.hf_source import HFTensorSource

    cfg, ctx = _init(arch, inputs)
    try:
        model = load_mcore_checkpoint(cfg, ckpt / "model_optim", ctx.groups)[0].eval()
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.model.architecture.vocab_size, (2, 40), generator=gen).to(ctx.device)
        pos = torch.arange(ids.shape[1], device=ctx.device).expand_as(ids)
        with torch.no_grad():
            got = model(input_ids=ids, position_ids=pos, attention_mask=None).float()
        del model
        bucket = cfg.weight_bucket_bytes()
        first, back, again = d / "hf", d / "mcore_back", d / "hf_again"
        summary = mcore_to_hf(cfg, ckpt / "model_optim", first, ctx.groups, bucket_bytes=bucket, progress=False)
        hf = load_hf_model(first, device=ctx.device)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits.float()
        del hf
        hf_to_mcore(cfg, first, back, ctx.groups, progress=False)
        mcore_to_hf(cfg, back, again, ctx.groups, bucket_bytes=bucket, progress=False)
        a, b = HFTensorSource.from_dir(first), HFTensorSource.from_dir(again)
        differ = sorted(set(a.names()) ^ set(b.names()))
        differ += [n for n in sorted(set(a.names()) & set(b.names())) if not torch.equal(a.get(n), b.get(n))]
        return {"tensors": summary["tensors"], "logits_max_diff": float((got - ref).abs().max()),
                "logits_scale": max(1.0, float(ref.abs().max())), "round_trip_differ": differ[:20],
                "round_trip_differ_count": len(differ), "device": str(ctx.device), "backend": ctx.backend}
    finally:
        ctx.teardown()


def _delivery(arch: str, inputs: dict, ckpt: Path, d: Path, device: str) -> dict:
    """Each WeightSync mode into a local engine server on `device`, checked by sha256, then greedy tokens."""
    import asyncio
    import urllib.request

    import torch

    from megatron_search.rollout.engine.auth import bearer_header, key_from_env
    from megatron_search.rollout.local.runner import load_hf_model
    from megatron_search.rollout.local.weights import load_named_tensors, weights_sha256
    from megatron_search.rollout.sglang.client import SGLangClient
    from megatron_search.rollout.local.launch import launch_local_server
    from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
    from megatron_search.weights.checkpoint import load_mcore_checkpoint
    from megatron_search.weights.delivery import WeightSync
    from megatron_search.weights.export import export_hf_weights

    cfg, ctx = _init(arch, inputs)
    server = None
    try:
        chunks = load_mcore_checkpoint(cfg, ckpt / "model_optim", ctx.groups)
        model_arch = cfg.model.architecture
        bucket = max(256 << 10, cfg.largest_weight_bytes())  # several buckets per push; the embedding travels whole
        server = launch_local_server(None, _engine_args(arch, inputs), d / "engine.log", timeout_s=300, device=device)
        # the independent reference: another seed, so a parameter no push reached shows
        reference = load_hf_model(cfg.model.resolved_hf_config(), seed=12345)
        out: dict = {"engine_device": device, "modes": {}}
        for k, mode in enumerate(MODES):
            with torch.no_grad():  # a new policy: every parameter changes before each push
                for p in chunks[0].parameters():
                    p.mul_(1.0 + 0.01 * (k + 1)).add_(0.001)
            sync = WeightSync([SGLangClient(server.url)], mode=mode, bucket_bytes=bucket, rank_node=[0],
                              engine_node=[0] if mode == "tensor" else None, disk_dir=d / "disk",
                              inflight="finish", backend="gloo", owns_engines=True)
            tag = f"{mode}-{k}"
            try:
                stats = sync.push(chunks, model_arch, ctx.groups, version=tag)
            finally:
                sync.close()
            for b in export_hf_weights(chunks, model_arch, bucket, ctx.groups):
                load_named_tensors(reference, b)
            want = weights_sha256(reference)
            probe = urllib.request.Request(f"{server.url}/local/weights_sha256", headers=bearer_header(key_from_env()))
            with urllib.request.urlopen(probe, timeout=300) as r:
                got = json.loads(r.read())
            keys = [n for n in want if ".visual." not in n]  # the vision tower is not trained, never synced
            out["modes"][mode] = {"version": got["weight_version"], "expected_version": tag, "buckets": stats.buckets,
                                  "params": len(keys), "mismatched": [n for n in keys if got["sha256"].get(n) != want[n]]}

        async def greedy():
            client = SGLangClient(server.url)
            try:
                sampling = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
                return (await client.generate(GenerateRequest(input_ids=GREEDY_PROMPT, sampling=sampling))).output_ids
            finally:
                await client.close()

        out["greedy_engine"] = list(asyncio.run(greedy()))
        hf = reference.to(ctx.device)
        seq = torch.tensor([GREEDY_PROMPT], device=ctx.device)
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):  # argmax over full forwards, no cache: not the engine's path
                seq = torch.cat([seq, hf(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        out["greedy_hf"] = seq[0, len(GREEDY_PROMPT):].tolist()
        return out
    finally:
        if server is not None:
            server.stop()
        ctx.teardown()


def _grpo(arch: str, inputs: dict, ckpt: Path, d: Path, device: str) -> dict:
    from megatron_search.config import load_config
    from megatron_search.rollout.local.launch import launch_local_server
    from megatron_search.train.grpo import run_grpo

    server = launch_local_server(None, _engine_args(arch, inputs), d / "engine.log", timeout_s=300, device=device)
    try:
        cfg = load_config(None, [
            *_common(arch, inputs), f"run.output_dir={d}", f"data.qa_path={inputs['qa']}", "data.mix={qa: 1.0}",
            f"rm.load={inputs['rm'][arch]}", "rm.max_length=96", f"grpo.steps={GRPO_STEPS}",
            "grpo.prompts_per_step=2", "grpo.group_size=6", "grpo.micro_batch_size=2",
            "grpo.reference_source=rollout_engines", f"checkpoint.load={ckpt}", "checkpoint.save_interval=1000",
            f"rollout.engine_urls=[{server.url}]", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
            "rollout.max_turns=2", f"optim.lr={GRPO_LR}"])
        run_grpo(cfg)
    finally:
        server.stop()
    return {**{k: _scalars(d, tag) for k, tag in GRPO_TAGS.items()}, "final_weights": str(d / "final_weights")}


def _scalars(run_dir: Path, tag: str) -> dict:
    """{step: value} of one TensorBoard tag that run_grpo logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    return {str(e.step): e.value for e in ea.Scalars(tag)} if tag in ea.Tags()["scalars"] else {}


# ---- parent: start both children, compare ------------------------------------------------------------

class _Child:
    """One side's process; its output goes to <work>/<side>.log."""

    def __init__(self, work: Path, side: str, archs, env: dict, prepare_inputs: bool):
        self.side, self.log = side, work / f"{side}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--work", str(work), "--side", side,
               "--archs", ",".join(archs)] + (["--prepare"] if prepare_inputs else [])
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def wait(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"{self.side} child did not finish in time; log tail:\n{self.tail()}") from None
        if self.proc.returncode:
            raise RuntimeError(f"{self.side} child exited with {self.proc.returncode}; log tail:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM first: the child's handler unwinds, so its engine servers (own sessions) are stopped too."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_train(chk, device, dry_run: bool, child_env: dict, timeout_s: float, archs=tuple(ARCHS)) -> None:
    """Both children, then every comparison recorded in `chk` (tools/gpu_selfcheck.py's Check)."""
    import tempfile

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    env = {k: v for k, v in child_env.items() if k != "TRITON_INTERPRET"}  # real kernels where CUDA is
    cpu_env = dict(env, CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory(prefix="selfcheck_train_") as tmp:
        work = Path(tmp)
        ref = _Child(work, "reference", archs, cpu_env, prepare_inputs=True)
        dev = None
        try:
            while not (work / "inputs.json").exists():
                if ref.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the reference child did not prepare the inputs; log tail:\n{ref.tail()}")
                time.sleep(0.5)
            prepared = time.monotonic() - t0
            dev = _Child(work, "device", archs, cpu_env if dry_run or device.type != "cuda" else env, False)
            dev.wait(deadline)
            ref.wait(deadline)
        finally:
            for c in (ref, dev):
                if c is not None:
                    c.stop()
        got, want = (json.loads((work / f"{s}.json").read_text()) for s in ("device", "reference"))
        chk.note("sides", device=got["device"], gpu=got["gpu"], reference=want["device"],
                 seconds_inputs=prepared, seconds_total=time.monotonic() - t0)
        for arch in archs:
            _compare(chk, arch, got["archs"][arch], want["archs"][arch])


def _rel(a: float, b: float, floor: float = 0.0) -> float:
    return abs(a - b) / max(abs(b), floor, 1e-30)


def _usable(chk, label: str, res: dict, stage: str) -> bool:
    """False (and counted as a failure, traceback printed) when `stage` failed or did not run."""
    r = res.get(stage)
    if r is not None and "error" not in r:
        return True
    print(f"       {label}.{stage} {'did not run' if r is None else 'failed:'}\n{'' if r is None else r['error']}",
          flush=True)
    chk.expect(f"{label}.{stage}.failed", 1.0, 0.0, "count")
    return False


def _compare(chk, arch: str, dev: dict, ref: dict) -> None:
    dev_ok, ref_ok = _usable(chk, arch, dev, "sft"), _usable(chk, f"{arch}.reference", ref, "sft")
    if dev_ok and ref_ok:
        s, r = dev["sft"], ref["sft"]
        chk.expect(f"{arch}.sft.steps_missing", float(2 * SFT_STEPS - len(s["loss"]) - len(r["loss"])), 0.0, "count")
        for i, (a, b) in enumerate(zip(s["loss"], r["loss"])):
            tol = TOL_FIRST if i == 0 else TOL_LATER
            chk.expect(f"{arch}.sft.step{i + 1}.loss", _rel(a, b), tol, "rel")
            chk.expect(f"{arch}.sft.step{i + 1}.grad_norm", _rel(s["grad_norm"][i], r["grad_norm"][i]), tol, "rel")
        chk.note(f"{arch}.sft", loss=s["loss"], grad_norm=s["grad_norm"], loss_tokens=s["tokens"],
                 seconds=s["seconds"], reference_seconds=r["seconds"])
    if _usable(chk, arch, dev, "convert"):
        c = dev["convert"]
        chk.expect(f"{arch}.convert.logits_vs_transformers", c["logits_max_diff"], TOL_LOGITS * c["logits_scale"])
        chk.expect(f"{arch}.convert.round_trip_tensors_differ", float(c["round_trip_differ_count"]), 0.0, "count")
        if c["round_trip_differ"]:
            print(f"       {arch}: the round trip changed {c['round_trip_differ']}")
        chk.note(f"{arch}.convert", tensors=c["tensors"], device=c["device"], backend=c["backend"], seconds=c["seconds"])
    if _usable(chk, arch, dev, "delivery"):
        dl = dev["delivery"]
        for mode, m in dl["modes"].items():
            chk.expect(f"{arch}.delivery.{mode}.params_mismatched", float(len(m["mismatched"])), 0.0, "count")
            chk.expect(f"{arch}.delivery.{mode}.wrong_version", float(m["version"] != m["expected_version"]), 0.0,
                       "count")
            if m["mismatched"]:
                print(f"       {arch}.{mode}: the engine differs from the export in {m['mismatched'][:8]}")
        wrong = sum(a != b for a, b in zip(dl["greedy_engine"], dl["greedy_hf"]))
        chk.expect(f"{arch}.delivery.greedy_tokens_vs_transformers",
                   float(wrong + abs(len(dl["greedy_engine"]) - len(dl["greedy_hf"]))), 0.0, "count")
        chk.note(f"{arch}.delivery", engine_device=dl["engine_device"], params=dl["modes"]["tensor"]["params"],
                 buckets=dl["modes"]["tensor"]["buckets"], seconds=dl["seconds"])
    dev_ok, ref_ok = _usable(chk, arch, dev, "grpo"), _usable(chk, f"{arch}.reference", ref, "grpo")
    if dev_ok and ref_ok:
        _compare_grpo(chk, arch, dev["grpo"], ref["grpo"])


def _compare_grpo(chk, arch: str, g: dict, r: dict) -> None:
    from safetensors.torch import load_file

    updated = sorted(set(g["loss"]) & set(r["loss"]), key=int)
    chk.expect(f"{arch}.grpo.steps_updated_on_one_side_only", float(len(set(g["loss"]) ^ set(r["loss"]))), 0.0, "count")
    chk.expect(f"{arch}.grpo.no_step_updated", float(not updated), 0.0, "count")
    for step in updated:
        n = int(step) + 1
        chk.expect(f"{arch}.grpo.step{n}.loss", _rel(g["loss"][step], r["loss"][step], 1.0), TOL_LATER, "rel")
        chk.expect(f"{arch}.grpo.step{n}.grad_norm", _rel(g["grad_norm"][step], r["grad_norm"][step]), TOL_LATER, "rel")
    chk.expect(f"{arch}.grpo.steps_missing", float(2 * GRPO_STEPS - len(g["reward"]) - len(r["reward"])), 0.0, "count")
    for step in sorted(r["reward"], key=int):
        n = int(step) + 1
        chk.expect(f"{arch}.grpo.step{n}.reward_mean", abs(g["reward"].get(step, float("nan")) - r["reward"][step]),
                   TOL_REWARD)
        chk.expect(f"{arch}.grpo.step{n}.response_tokens",
                   abs(g["response_tokens"].get(step, float("nan")) - r["response_tokens"][step]), 0.0)
    for side, res in (("device", g), ("reference", r)):
        k3 = max((abs(v) for v in res["mismatch_k3"].values()), default=float("nan"))
        chk.expect(f"{arch}.grpo.{side}.engine_vs_trainer_k3", k3, TOL_K3, "max|k3|")
    a, b = (load_file(str(Path(x["final_weights"]) / "model.safetensors")) for x in (g, r))
    chk.expect(f"{arch}.grpo.final_weights_names_differ", float(len(set(a) ^ set(b))), 0.0, "count")
    common = sorted(set(a) & set(b))
    diff = {n: (a[n].double() - b[n].double()) for n in common}
    norm = sum(float(b[n].double().pow(2).sum()) for n in common) ** 0.5
    chk.expect(f"{arch}.grpo.final_weights", sum(float(x.pow(2).sum()) for x in diff.values()) ** 0.5 / max(norm, 1e-30),
               TOL_WEIGHTS, "rel_l2")
    worst = max(common, key=lambda n: float(diff[n].abs().max()))
    chk.note(f"{arch}.grpo", updated_steps=len(updated), loss=[g["loss"][s] for s in updated],
             grad_norm=[g["grad_norm"][s] for s in updated], reward=list(g["reward"].values()),
             zero_signal_groups=list(g["zero_signal_groups"].values()), worst_param=worst,
             worst_abs_diff=float(diff[worst].abs().max()), seconds=g["seconds"], reference_seconds=r["seconds"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one side of the train check (started by tools/gpu_selfcheck.py)")
    p.add_argument("--work", required=True)
    p.add_argument("--side", choices=("device", "reference"), required=True)
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--prepare", action="store_true", help="build the shared inputs first")
    args = p.parse_args(argv)
    # the parent's timeout: unwind (finally blocks stop the engine servers, which run in their own sessions)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_selfcheck

    gpu_selfcheck.use_checkout()
    work = Path(args.work)
    inputs = prepare(work) if args.prepare else json.loads((work / "inputs.json").read_text())
    result = run_side(work, args.side, inputs, [a for a in args.archs.split(",") if a])
    tmp = work / f"{args.side}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, work / f"{args.side}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
