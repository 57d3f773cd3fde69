"""The rubric judge inside GRPO on CPU (issue 22.2), end to end: rubric-chat prompts in the mix, the policy's
answers graded by an OpenAI-compatible judge over HTTP (reward.rubric_judge), the verdicts as r_base.

The world is the learning test's SFT policy (tests/_grpo_learning.py), which answers "yes" or "no". The rubric
("The reply is polite and friendly") is one the mechanical checks cannot decide, so every answered rollout
goes to the judge: a scripted server in this process that passes an answer iff it says "yes" and records
what it was asked. r_base of the step must be the share of "yes" answers the judge saw.
"""
import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parent))

RUBRIC = "The reply is polite and friendly"


def _judge_server(seen: list):
    """Start the scripted judge on a free 127.0.0.1 port in a thread; returns (url, stop)."""
    from aiohttp import web

    async def completions(request):
        prompt = (await request.json())["messages"][-1]["content"]
        response = prompt.split("Response to grade:\n", 1)[1].split("\n\nCriteria:", 1)[0].strip()
        seen.append(response)
        verdict = {"verdicts": [{"index": 1, "pass": "yes" in response.lower(), "reason": "-"}]}
        return web.json_response({"choices": [{"message": {"content": json.dumps(verdict)}, "finish_reason": "stop"}]})

    loop = asyncio.new_event_loop()
    ready, box = threading.Event(), {}

    def serve():
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["url"], box["runner"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait(30)

    def stop():
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)

    return box["url"], stop


def test_rubric_prompts_are_graded_by_the_judge_in_a_grpo_step(tmp_path):
    import _grpo_learning as g
    from _mp import run_spawned
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_search.data.jsonl import write_jsonl
    from megatron_search.data.rubric_checks import check_rubric

    assert check_rubric(RUBRIC, "yes") is None  # undecidable mechanically: the judge must grade it
    fx = g.build(tmp_path, seed=3)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": g.QUESTION.format(name=name)}], "rubrics": [RUBRIC]}
            for i, name in enumerate(["Kalo", "Miravo", "Tosune", "Barfel"])]
    write_jsonl(tmp_path / "rubric.jsonl", rows)
    seen: list = []
    url, stop = _judge_server(seen)
    try:
        grpo = g.grpo_overrides(fx, "judged", 1, 1e-3, 3, extra=[
            f"data.rubric_path={tmp_path / 'rubric.jsonl'}", "data.mix={rubric: 1.0}",
            f"reward.rubric_judge={{base_url: '{url}', model: judge, retries: 0}}"])
        run_spawned(g.pipeline_worker, 1, fx, {"sft": g.sft_overrides(fx, 40, 3e-3, 3), "rm": g.rm_args(fx),
                                               "grpo": [("judged", grpo)]})
    finally:
        stop()
    ea = EventAccumulator(str(tmp_path / "judged" / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    val = {t: ea.Scalars(t)[0].value for t in ea.Tags()["scalars"]}
    n = g.PROMPTS_PER_STEP * g.GROUP_SIZE
    answered = round(n * (1 - val["rollout/no_answer"]))
    assert len(seen) == answered == val["reward/rubric_judge_calls"] > 0, (len(seen), answered, val)
    assert val["reward/rubric_judge_malformed"] == 0 and val["reward/rubric_mechanical"] == 0
    yes = sum("yes" in s.lower() for s in seen)
    assert 0 < yes < len(seen), seen  # the SFT policy says both
    assert abs(val["reward/r_base"] - yes / n) < 1e-6, (val["reward/r_base"], yes, n)
