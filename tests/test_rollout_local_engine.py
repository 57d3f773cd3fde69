"""Local CPU engine in process: batched cached decode vs a plain HF forward (logprobs, routed
experts), prefix reuse, sampling controls, weight updates by HF name, pause/abort.

References are computed here with plain transformers calls on the same model object (no cache,
one sequence, `output_router_logits`), independent of the engine's cache stacking and hooks.
"""
import asyncio

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.tensor_payload import WeightUpdateError
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.local.runner import load_hf_model

MODELS = {"qwen3_moe": "configs/models/tiny_qwen3_moe", "qwen3_5_moe": "configs/models/tiny_qwen3_5_moe"}


@pytest.fixture(scope="module", params=list(MODELS))
def engine(request):
    return LocalEngine(MODELS[request.param], seed=0, max_running_requests=16)


@pytest.fixture(scope="module")
def qwen3(request):
    return LocalEngine(MODELS["qwen3_moe"], seed=0, max_running_requests=16)


def prompts(n, lo=3, hi=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2048, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


@torch.no_grad()
def plain_logprobs(model, ids, temperature):
    """log p(ids[t+1] | ids[:t+1]) from one uncached forward, fp32."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@torch.no_grad()
def plain_router_topk(model, ids, top_k):
    """[len, layers, top_k] experts from the router logits of one uncached forward (sorted by prob)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    per_layer = [torch.topk(torch.softmax(r.float(), -1), top_k, dim=-1).indices for r in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_batched_generation_matches_plain_forward(engine):
    ps = prompts(12)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=i),
                            return_routed_experts=True, routed_experts_start_len=len(p) // 2) for i, p in enumerate(ps)]

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    results = run(go())
    model = engine.runner.model
    for p, req, res in zip(ps, reqs, results):
        ids = p + res.output_ids
        assert len(res.output_ids) == 10 and res.finish_reason.type == "length"
        ref = plain_logprobs(model, ids, 0.7)[len(p) - 1:]
        assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
        want = plain_router_topk(model, ids, 2)[req.routed_experts_start_len : len(ids) - 1]
        assert res.routed_experts_NLK.shape == (len(ids) - 1 - req.routed_experts_start_len, 4, 2)
        np.testing.assert_array_equal(res.routed_experts_NLK, want)


def test_next_turn_reuses_prefix_and_stays_exact(engine):
    p = prompts(1, 20, 21, seed=3)[0]
    first = run(engine.generate(GenerateRequest(p, SamplingParams(max_new_tokens=6, seed=1))))
    turn2 = p + first.output_ids + [7, 8, 9, 10]
    start = len(p) + len(first.output_ids) - 1
    second = run(engine.generate(GenerateRequest(turn2, SamplingParams(max_new_tokens=6, seed=2),
                                                 return_routed_experts=True, routed_experts_start_len=start)))
    assert second.cached_tokens == len(p) + len(first.output_ids) - 1  # the earlier sequence minus its last token
    ids = turn2 + second.output_ids
    ref = plain_logprobs(engine.runner.model, ids, 1.0)[len(turn2) - 1:]
    assert torch.allclose(torch.tensor(second.output_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(second.routed_experts_NLK, plain_router_topk(engine.runner.model, ids, 2)[start:-1])
    run(engine.flush_cache())
    assert len(engine.prefix) == 0


def test_sampling_controls(qwen3):
    p = prompts(1, 8, 9, seed=5)[0]
    model = qwen3.runner.model
    greedy = run(qwen3.generate(GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0.0))))
    ids = list(p)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert greedy.output_ids == ids[len(p):]
    # top_p so small that only the most likely token survives: sampling == greedy
    narrow = run(qwen3.generate(GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=9))))
    assert narrow.output_ids == greedy.output_ids
    # same seed, same tokens; stop ids end the turn and are kept
    a = run(qwen3.generate(GenerateRequest(p, SamplingParams(max_new_tokens=8, seed=42))))
    b = run(qwen3.generate(GenerateRequest(p, SamplingParams(max_new_tokens=8, seed=42))))
    assert a.output_ids == b.output_ids
    stop = a.output_ids[2]
    c = run(qwen3.generate(GenerateRequest(p, SamplingParams(max_new_tokens=8, seed=42, stop_token_ids=(stop,)))))
    first = a.output_ids.index(stop)
    assert c.output_ids == a.output_ids[: first + 1]
    assert (c.finish_reason.type, c.finish_reason.matched) == ("stop", stop)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(qwen3.generate(GenerateRequest([5, 2048])))


def per_expert_names(model):
    """HF checkpoint layout for Qwen3-MoE: fused experts split back into per-expert tensors."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len(".gate_up_proj")], p.shape[1] // 2
            for j in range(p.shape[0]):
                out += [(f"{base}.{j}.gate_proj.weight", p[j, :half]), (f"{base}.{j}.up_proj.weight", p[j, half:])]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            out += [(f"{base}.{j}.down_proj.weight", p[j]) for j in range(p.shape[0])]
        else:
            out.append((name, p))
    return [(n, t.detach().clone()) for n, t in out]


def test_weight_update_by_hf_name(tmp_path):
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    other = load_hf_model(MODELS["qwen3_moe"], seed=1)
    p = prompts(1, 10, 11, seed=7)[0]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = run(eng.generate(GenerateRequest(p, greedy)))
    original = per_expert_names(eng.runner.model)

    # per-expert names land in the fused tensors: the engine then IS the other model
    run(eng.begin_weight_update())  # tensor updates run inside a session (SGLang >= 0.5.23)
    run(eng.update_weights_from_tensor(per_expert_names(other), weight_version="v1"))
    for (n, a), (_, b) in zip(eng.runner.model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n
    after = run(eng.generate(GenerateRequest(p, greedy)))
    assert after.weight_version == "v1" and after.output_ids != before.output_ids

    # a bad tensor anywhere in the update leaves the model untouched
    snapshot = {n: t.clone() for n, t in eng.runner.model.state_dict().items()}
    bad = [("lm_head.weight", torch.zeros(2048, 64)), ("model.layers.0.mlp.gate.weight", torch.zeros(3, 64))]
    with pytest.raises(WeightUpdateError, match=r"model.layers.0.mlp.gate.weight: shape \(3, 64\)"):
        run(eng.update_weights_from_tensor(bad))
    with pytest.raises(WeightUpdateError, match="no such parameter"):
        run(eng.update_weights_from_tensor([("model.layers.0.mlp.gatee.weight", torch.zeros(4, 64))]))
    for n, t in eng.runner.model.state_dict().items():
        assert torch.equal(t, snapshot[n]), n
    run(eng.end_weight_update())

    # from disk (HF per-expert checkpoint layout) back to the original weights
    save_file(dict(original), str(tmp_path / "model.safetensors"))
    run(eng.update_weights_from_disk(str(tmp_path), weight_version="v2"))
    again = run(eng.generate(GenerateRequest(p, greedy)))
    assert again.output_ids == before.output_ids and again.weight_version == "v2"


def test_pause_abort_and_release():
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    p = prompts(2, 5, 6, seed=11)

    async def scenario():
        await eng.pause_generation("in_place")
        pending = asyncio.ensure_future(eng.generate(GenerateRequest(p[0], SamplingParams(max_new_tokens=4))))
        await asyncio.sleep(0.2)
        assert not pending.done() and eng.steps == 0  # paused: nothing stepped
        await eng.continue_generation()
        done = await pending
        assert len(done.output_ids) == 4
        steps = eng.steps
        long = asyncio.ensure_future(eng.generate(GenerateRequest(p[1], SamplingParams(max_new_tokens=2000))))
        while eng.steps < steps + 3:
            await asyncio.sleep(0.01)
        await eng.pause_generation("abort")
        aborted = await long
        assert aborted.finish_reason.type == "abort" and 0 < len(aborted.output_ids) < 2000
        await eng.continue_generation()
        await eng.release_memory_occupation(["weights"])
        assert await eng.health()  # SGLang's /ready: reads no memory, so it answers while memory is released
        with pytest.raises(EngineError, match="released"):  # generating on released memory: refused, loudly
            await eng.generate(GenerateRequest(p[0], SamplingParams(max_new_tokens=1)))
        await eng.begin_weight_update()
        with pytest.raises(EngineError, match="released"):
            await eng.update_weights_from_tensor([("lm_head.weight", torch.zeros(2048, 64))])
        await eng.end_weight_update()
        await eng.resume_memory_occupation(["weights"])
        assert await eng.health()
        await eng.close()

    run(scenario())


def test_identical_prompts_share_one_prefill(qwen3):
    p = prompts(1, 12, 13, seed=13)[0]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=5, seed=100 + i)) for i in range(6)]

    async def go():
        return await asyncio.gather(*(qwen3.generate(r) for r in reqs))

    results = run(go())
    assert sorted(r.cached_tokens for r in results)[1:] == [len(p)] * 5  # one real prefill, five shared
    assert len({tuple(r.output_ids) for r in results}) > 1  # own seeds, own samples
    for r in results:
        ref = plain_logprobs(qwen3.runner.model, p + r.output_ids, 1.0)[len(p) - 1:]
        assert torch.allclose(torch.tensor(r.output_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_shared_head_reused_at_block_boundary(engine):
    head = prompts(1, 40, 41, seed=17)[0]
    a, b = head + [1, 2, 3], head + [4, 5, 6, 7]
    run(engine.generate(GenerateRequest(a, SamplingParams(max_new_tokens=2, seed=1))))
    res = run(engine.generate(GenerateRequest(b, SamplingParams(max_new_tokens=4, seed=2), return_routed_experts=True)))
    # attention-only KV can be cut to the shared head (block 32); GDN recurrent state cannot
    assert res.cached_tokens == (32 if engine.runner.can_crop else 0)
    ids = b + res.output_ids
    ref = plain_logprobs(engine.runner.model, ids, 1.0)[len(b) - 1:]
    assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(res.routed_experts_NLK, plain_router_topk(engine.runner.model, ids, 2)[:-1])


def test_top_p_keeps_the_nucleus_only():
    from types import SimpleNamespace

    from megatron_search.rollout.local.engine import sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    a = SimpleNamespace(req=SimpleNamespace(sampling=SamplingParams(temperature=1.0, top_p=0.6)),
                        generator=torch.Generator().manual_seed(0))
    draws = [sample_tokens(logits, [a], original_logprob=False)[0] for _ in range(2000)]
    counts = np.bincount([t for t, _ in draws], minlength=3)
    assert counts[2] == 0  # outside the 0.6 nucleus {0, 1}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04  # renormalised inside the nucleus
    # the reported logprob is of the full (temperature-scaled) distribution, not the truncated one
    assert {round(lp, 5) for t, lp in draws if t == 0} == {round(float(np.log(0.5)), 5)}


def test_cached_states_own_their_memory(qwen3):
    """A finished request's state is kept for reuse; decoded rows are views into the batch's cache, so the
    kept copy must own its storage (else every entry pins the whole batch: B times its size)."""
    run(qwen3.flush_cache())
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=8, seed=i), return_routed_experts=True)
            for i, p in enumerate(prompts(8, seed=5))]

    async def go():
        return await asyncio.gather(*(qwen3.generate(r) for r in reqs))

    run(go())
    kept = list(qwen3.prefix._entries.values())
    assert len(kept) >= 8
    for state in kept:
        for k, v in state.layers:
            for t in (k, v):
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert all(e.base is None for e in state.experts)
        assert len(state.routed_experts()) == len(state.tokens)


# --- the request orders SGLang 0.5.23 refuses: the local engine refuses each of them too ----------
# (sglang/srt/managers/scheduler_components/weight_updater.py: sessions, flush after update;
#  scheduler.py: flush_cache and release_memory_occupation only when idle; resume of an unreleased tag)

async def _running_request(eng, prompt, max_new_tokens: int = 2000):
    """A long request that is being decoded (in the running batch) when this returns."""
    steps = eng.steps
    task = asyncio.ensure_future(eng.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens))))
    while eng.steps < steps + 2:
        await asyncio.sleep(0.01)
    return task


def test_weight_updates_outside_a_session_are_refused():
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    lm = [("lm_head.weight", eng.runner.model.lm_head.weight.detach().clone())]

    async def scenario():
        with pytest.raises(EngineError, match="between begin_weight_update"):
            await eng.update_weights_from_tensor(lm)
        with pytest.raises(EngineError, match="between begin_weight_update"):
            await eng.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[2048, 64]], "g")
        with pytest.raises(EngineError, match="no weight-update session"):
            await eng.end_weight_update()
        await eng.begin_weight_update()
        with pytest.raises(EngineError, match="already open"):
            await eng.begin_weight_update()
        await eng.update_weights_from_tensor(lm, weight_version="s1")
        await eng.end_weight_update()
        assert eng.weight_version == "s1"
        # NCCL broadcasts land in CUDA memory: a CPU engine refuses the group before anyone blocks on it
        with pytest.raises(EngineError, match=r"backend 'nccl' needs the engine on a CUDA device.*rollout.local.device"):
            await eng.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "nccl")
        with pytest.raises(EngineError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
            await eng.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "mpi")
        await eng.close()

    run(scenario())


def test_flush_while_requests_are_held_in_place_is_refused_and_retract_makes_it_safe():
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    p = prompts(1, 8, 9, seed=21)[0]
    lm = [("lm_head.weight", eng.runner.model.lm_head.weight.detach().clone())]

    async def scenario():
        task = await _running_request(eng, p, max_new_tokens=64)  # it finishes after the update: keep it short
        await eng.pause_generation("in_place")  # the request keeps its KV in the running batch
        with pytest.raises(EngineError, match="Cache not flushed"):
            await eng.flush_cache()
        await eng.begin_weight_update()
        with pytest.raises(EngineError, match="Weights were updated, but the cache was not flushed"):
            await eng.update_weights_from_tensor(lm, weight_version="held", flush_cache=True)
        assert eng.weight_version == "held"  # like SGLang: recorded on the load, before the flush check
        await eng.pause_generation("retract")  # back to the queue, KV freed: idle while paused
        await eng.update_weights_from_tensor(lm, weight_version="v2", flush_cache=True)
        await eng.flush_cache()
        await eng.end_weight_update()
        await eng.continue_generation()
        done = await task  # the retracted request finishes on the new weights
        assert done.finish_reason.type != "abort" and done.weight_version == "v2"
        await eng.close()

    run(scenario())


def test_release_when_busy_and_resume_of_an_unreleased_tag_are_refused():
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    p = prompts(1, 8, 9, seed=22)[0]

    async def scenario():
        task = await _running_request(eng, p)
        with pytest.raises(EngineError, match="must be idle"):
            await eng.release_memory_occupation(["kv_cache"])
        with pytest.raises(EngineError, match="never released"):
            await eng.resume_memory_occupation(["weights"])
        await eng.pause_generation("abort")
        await task
        await eng.release_memory_occupation(["kv_cache"])
        with pytest.raises(EngineError, match=r"\['weights'\] were never released"):
            await eng.resume_memory_occupation(None)
        await eng.resume_memory_occupation(["kv_cache"])
        await eng.continue_generation()
        await eng.close()

    run(scenario())


def test_device_is_where_the_model_lives_and_sampling_stays_on_the_host(capsys):
    """The engine's model, cache rows and fed ids sit on `device` (CPU here); logits come back to the host,
    where the per-request CPU generators sample. A server asked for CUDA without a GPU says so and exits 2."""
    from megatron_search.rollout.local.server import main as serve

    eng = LocalEngine(MODELS["qwen3_5_moe"], seed=0, device="cpu")
    assert eng.device == eng.runner.device == torch.device("cpu")
    assert {p.device for p in eng.runner.model.parameters()} == {torch.device("cpu")}
    state, logits = eng.runner.prefill(prompts(1, 6, 7, seed=31)[0])
    assert logits.device.type == "cpu" and logits.dtype == torch.float32
    assert {t.device.type for pair in state.layers for t in pair} == {"cpu"}
    if not torch.cuda.is_available():
        assert serve([f"model.hf_config={MODELS['qwen3_moe']}", "--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
