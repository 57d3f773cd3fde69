"""The local engine's persistent batched cache (`RunningBatch`) and batched sampling.

Every reference is computed here independently: the logits of a row are those of one uncached
plain transformers forward over that row's whole token sequence (no cache, no padding, batch 1),
its routed experts the top-k of that forward's router logits, and sampled tokens those of
`torch.multinomial` row by row with a generator seeded the same way.
"""
import asyncio
import threading

import numpy as np
import pytest
import torch

from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.engine import LocalEngine, sample_tokens
from megatron_search.rollout.local.runner import ModelRunner, RunningBatch, load_hf_model

MODELS = {"qwen3_moe": "configs/models/tiny_qwen3_moe", "qwen3_5_moe": "configs/models/tiny_qwen3_5_moe"}


@pytest.fixture(scope="module", params=list(MODELS))
def runner(request):
    return ModelRunner(load_hf_model(MODELS[request.param], seed=0))


def ids(n, seed):
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def plain_last_logits(model, seq):
    return model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()


@torch.no_grad()
def plain_topk(model, seq, k=2):
    out = model(input_ids=torch.tensor([seq]), use_cache=False, output_router_logits=True)
    return torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1).numpy()


@torch.no_grad()
def plain_reference(model, seq, k=2):
    """plain_last_logits and plain_topk from one forward (the router logits do not change the logits)."""
    out = model(input_ids=torch.tensor([seq]), use_cache=False, output_router_logits=True)
    experts = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)
    return out.logits[0, -1].float(), experts.numpy()


def check_rows(batch, logits, rows=None):
    """Each row's logits equal a plain forward over the row's tokens; its lengths and experts line up."""
    model = batch.runner.model
    for j, r in enumerate(rows if rows is not None else range(len(batch))):
        seq = batch.tokens[r]
        assert batch.lengths[r] == len(seq)
        ref_logits, ref_experts = plain_reference(model, seq)
        torch.testing.assert_close(logits[j], ref_logits, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(batch.routed_experts(batch.owners[r]), ref_experts)


def test_rows_join_leave_and_grow_stay_exact(runner):
    """Continuous batching on the persistent cache: a padded multi-group prefill (3 to 90 tokens), decode
    steps, rows leaving from the middle (the last row moves in), rows joining from a stored prefix and as a
    forked pair, and the columns growing past their first capacity: every row always equals a plain forward."""
    batch = RunningBatch(runner, max_rows=8, max_prefill_tokens=128)
    owners = [object() for _ in range(5)]
    targets = [ids(n, s) for n, s in zip([3, 40, 17, 90, 5], range(5))]
    before = batch.forwards
    logits = batch.admit([(t, None, [o]) for t, o in zip(targets, owners)])
    assert batch.forwards - before > 1  # 128 padded tokens per forward: the 90-token input goes apart
    order = [batch._row(o) for o in owners]
    check_rows(batch, logits[[order.index(r) for r in range(5)]])
    assert batch.cap_cols == 128 and batch.cap_rows == 8  # powers of two, not the 4096-token context

    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        check_rows(batch, batch.decode(torch.randint(0, 2048, (len(batch),), generator=g).tolist()))

    kept = batch.export(owners[1])
    assert kept.tokens == batch.tokens[batch._row(owners[1])]
    batch.remove(owners[1])  # a middle row: the last row takes its place
    batch.remove(owners[3])
    assert len(batch) == 3 and all(o in batch for o in (owners[0], owners[2], owners[4]))
    check_rows(batch, batch.decode([11, 12, 13]))

    cont, fresh, twins = object(), object(), (object(), object())
    logits = batch.admit([(kept.tokens + ids(6, 50), kept, [cont]), (ids(30, 51), None, [fresh]),
                          (ids(9, 52), None, list(twins))])
    assert len(batch) == 7 and batch.tokens[batch._row(twins[0])] == batch.tokens[batch._row(twins[1])]
    check_rows(batch, logits, [batch._row(o) for o in (cont, fresh, twins[0])])
    while max(batch.lengths) < 140:  # past the first 128 columns
        check_rows(batch, batch.decode(torch.randint(0, 2048, (len(batch),), generator=g).tolist()))
    assert batch.cap_cols == 256

    for o in list(batch.owners):
        batch.remove(o)
    assert len(batch) == 0 and batch.nbytes() == 0 and batch.bufs == []


def test_capacity_shrinks_when_use_falls_to_a_quarter(runner):
    batch = RunningBatch(runner, max_rows=64)
    owners = [object() for _ in range(32)]
    batch.admit([(ids(5 if i else 200, i), None, [o]) for i, o in enumerate(owners)])
    assert (batch.cap_rows, batch.cap_cols) == (32, 256)
    full = batch.nbytes()
    for o in owners[:-4]:  # the 200-token row leaves too; 4 rows of 5 tokens stay
        batch.remove(o)
    batch.fit()
    assert (batch.cap_rows, batch.cap_cols) == (4, 64) and batch.nbytes() < full / 8
    check_rows(batch, batch.decode([1, 2, 3, 4]))


def test_hybrid_rows_continuing_a_prefix_are_never_padded(runner):
    """A GDN state cannot pass through padding (it would decay): rows continuing a prefix share a forward only
    with rows of their own new length. Attention-only models pad them like any other row."""
    batch = RunningBatch(runner, max_rows=8)
    base = [object(), object()]
    batch.admit([(ids(20, 60), None, [base[0]]), (ids(33, 61), None, [base[1]])])
    states = [batch.export(o) for o in base]
    tails = [ids(4, 62), ids(4, 63), ids(9, 64)]
    rows = [object() for _ in tails]
    before = batch.forwards
    logits = batch.admit([(states[0].tokens + tails[0], states[0], [rows[0]]),
                          (states[1].tokens + tails[1], states[1], [rows[1]]),
                          (states[0].tokens + tails[2], states[0], [rows[2]])])
    assert batch.forwards - before == (2 if runner.hybrid else 1)
    check_rows(batch, logits, [batch._row(o) for o in rows])


def test_prefill_through_model_runner_matches_plain_forward(runner):
    seq = ids(25, 70)
    state, logits = runner.prefill(seq[:18])
    state2, logits2 = runner.prefill(seq[18:], state)
    assert state2.tokens == seq and len(state2.routed_experts()) == len(seq)
    torch.testing.assert_close(logits2, plain_last_logits(runner.model, seq), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(state2.routed_experts(), plain_topk(runner.model, seq))


def _reference_sample(logits, temperature, top_p, generator):
    """The per-row sampler the batched one must equal: multinomial over softmax(logits / T), top-p nucleus."""
    if temperature == 0:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, -1)[tok])
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        sorted_p = sorted_p.masked_fill((torch.cumsum(sorted_p, 0) - sorted_p) > top_p, 0.0)
        tok = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)])
    else:
        tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])


def test_batched_sampling_draws_what_multinomial_draws_row_by_row():
    from types import SimpleNamespace

    logits = torch.randn(24, 2048, generator=torch.Generator().manual_seed(3)) * 3
    params = [(t, p) for t in (0.0, 0.6, 1.0, 1.3) for p in (1.0, 0.9, 0.5)] * 2
    actives = [SimpleNamespace(req=SimpleNamespace(sampling=SamplingParams(temperature=t, top_p=p)),
                               generator=torch.Generator().manual_seed(100 + i)) for i, (t, p) in enumerate(params)]
    # same seeds: batched and per-row draws agree token for token, step after step, with the same logprobs
    ref_gens = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    for _ in range(4):
        got = sample_tokens(logits, actives, original_logprob=False)
        want = [_reference_sample(logits[i], t, p, ref_gens[i]) for i, (t, p) in enumerate(params)]
        assert [g[0] for g in got] == [w[0] for w in want]
        np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=0, atol=1e-6)
    raw = sample_tokens(logits, actives, original_logprob=True)
    full = torch.log_softmax(logits, -1)
    assert [lp for _, lp in raw] == pytest.approx([float(full[i, t]) for i, (t, _) in enumerate(raw)], abs=1e-6)


@pytest.mark.parametrize("model", list(MODELS))
def test_inputs_admitted_together_compute_their_shared_head_once(model):
    """Different questions under one system prompt arrive together: the head (cut at a 32-token block) is
    prefilled once and every input feeds only its tail, hybrid models included (a stored head is an exact
    prefix, so its GDN state is exact). Logprobs still equal a plain forward."""
    eng = LocalEngine(MODELS[model], seed=0, max_running_requests=16)
    head = ids(70, 80)
    prompts = [head + ids(3 + i, 81 + i) for i in range(5)]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=4, seed=i), return_logprob=True,
                            return_routed_experts=True) for i, p in enumerate(prompts)]

    async def go():
        await eng.pause_generation("in_place")  # queue all five, then admit them in one step
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in reqs]
        await asyncio.sleep(0.05)
        await eng.continue_generation()
        out = await asyncio.gather(*tasks)
        await eng.close()
        return out

    results = asyncio.run(go())
    assert [r.cached_tokens for r in results] == [64] * 5
    m = eng.runner.model
    for p, r in zip(prompts, results):
        seq = p + r.output_ids
        logits = m(input_ids=torch.tensor([seq]), use_cache=False).logits[0, len(p) - 1:-1].double()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.output_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(r.routed_experts_NLK, plain_topk(m, seq)[:-1])


def test_engine_runs_torch_on_one_thread_and_frees_the_batch():
    """Every forward runs on the engine's own worker thread (one OpenMP team per process); the running batch
    holds memory only while requests run, and releasing 'kv_cache' frees it."""
    eng = LocalEngine(MODELS["qwen3_moe"], seed=0)
    threads = set()
    eng.runner.model.register_forward_pre_hook(lambda *_: threads.add(threading.current_thread().name))
    prompt = ids(12, 90)

    async def scenario():
        done = await eng.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=3)))
        assert len(done.output_ids) == 3 and eng.batch.nbytes() == 0  # finished: rows gone, tensors freed
        steps = eng.steps
        task = asyncio.ensure_future(eng.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=2000))))
        while eng.steps < steps + 3:
            await asyncio.sleep(0.01)
        await eng.pause_generation("in_place")
        held = eng.memory_bytes()["kv_cache"]
        assert eng.batch.nbytes() > 0 and held == eng.batch.nbytes() + eng.prefix.nbytes()
        await eng.pause_generation("retract")
        assert eng.batch.nbytes() == 0 and eng.batch.bufs == []
        await eng.release_memory_occupation(["kv_cache"])
        assert eng.memory_bytes()["kv_cache"] == 0
        await eng.resume_memory_occupation(["kv_cache"])
        await eng.continue_generation()
        await asyncio.sleep(0.05)
        await eng.pause_generation("abort")
        assert (await task).finish_reason.type == "abort"
        await eng.close()

    asyncio.run(scenario())
    assert threads and all(t.startswith("local-engine") for t in threads)
