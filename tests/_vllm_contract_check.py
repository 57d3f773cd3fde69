"""Child process of tests/test_rollout_vllm_contract.py: our vLLM client and the local server's vLLM API against
vLLM 0.33.0's own code (its pydantic request/response models, SamplingParams, weight-transfer info classes,
route tables and AuthenticationMiddleware). Prints one JSON line of findings."""
import asyncio
import json
import sys

# vLLM's protocol module first: importing vllm.sampling_params on its own first trips a circular import in
# transformers' tokenizer modules
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (GenerateLogProbs, GenerateLogProbsContent,  # noqa: E402
                                                                    GenerateRequest, GenerateTokensChoice,
                                                                    GenerateTokensResponse)

import numpy as np  # noqa: E402
import vllm  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo  # noqa: E402
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo  # noqa: E402
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware  # noqa: E402
from vllm.outputs import WeightVersionSpan  # noqa: E402
from vllm.sampling_params import SamplingParams as VSamplingParams  # noqa: E402
from vllm.utils.serial_utils import numpy2base64  # noqa: E402

from megatron_search.rollout.local.vllm_api import parse_vllm_generate, vllm_request_allowed  # noqa: E402
from megatron_search.rollout.engine.types import GenerateRequest as OurRequest, SamplingParams  # noqa: E402
from megatron_search.rollout.vllm.client import VLLMClient  # noqa: E402

problems: list[str] = []
checked: set[str] = set()


def vllm_routes() -> set[tuple[str, str]]:
    from vllm.entrypoints.openai.models.api_router import router as models
    from vllm.entrypoints.rl.online.api_router import router as rl
    from vllm.entrypoints.scale_out.token_in_token_out.api_router import abort_router, router as tokens
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc
    from vllm.entrypoints.serve.dev.server_info.api_router import router as server_info
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep
    from vllm.entrypoints.serve.instrumentator.health import router as health

    out = set()
    for r in (models, rl, tokens, abort_router, cache, rpc, server_info, sleep, health):
        for route in r.routes:
            for m in getattr(route, "methods", ()):
                out.add((m, route.path))
    return out


def sampling_fields() -> set[str]:
    return set(VSamplingParams.__struct_fields__)


REQUESTS = [
    OurRequest([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.7, seed=11, stop_token_ids=(7, 9))),
    OurRequest([4, 5], SamplingParams(max_new_tokens=1, temperature=0.0), return_logprob=False, rid="r-1"),
    OurRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=8, top_p=0.5, ignore_eos=True),
               return_routed_experts=True, routed_experts_start_len=2),
]


def check_generate_requests(client: VLLMClient) -> None:
    checked.add("POST /inference/v1/generate")
    fields = set(GenerateRequest.model_fields)
    sfields = sampling_fields()
    for req in REQUESTS:
        body = client.generate_payload(req)
        for k in body:
            if k not in fields:
                problems.append(f"generate: {k!r} is not a GenerateRequest field (vLLM would ignore it)")
        for k in body["sampling_params"]:
            if k not in sfields:
                problems.append(f"generate: sampling_params.{k} is not a vLLM SamplingParams field")
        try:
            v = GenerateRequest.model_validate(json.loads(json.dumps(body)))
        except Exception as e:  # noqa: BLE001
            problems.append(f"generate: vLLM refuses {body}: {e}")
            continue
        sp, s = v.sampling_params, req.sampling
        want = {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos, "detokenize": False,
                "logprobs": 0 if req.return_logprob else None,
                "routed_experts_prompt_start": req.routed_experts_start_len if req.return_routed_experts else 0}
        got = {k: getattr(sp, k) for k in want}
        got["stop_token_ids"] = list(got["stop_token_ids"] or [])
        if got != want:
            problems.append(f"generate: vLLM parsed {got}, we meant {want}")
        if v.token_ids != req.input_ids or v.output_mode != "tokens" or v.stream:
            problems.append(f"generate: token_ids/output_mode/stream parsed as {v.token_ids}/{v.output_mode}/{v.stream}")
        if req.rid is not None and v.request_id != req.rid:
            problems.append(f"generate: request_id {v.request_id!r} != {req.rid!r}")
        if not v.is_sampling_param_provided("max_tokens"):
            problems.append("generate: max_tokens not seen as provided (vLLM would default it)")
        # the local server accepts what we send, with the same meaning
        ours, _ = parse_vllm_generate(json.loads(json.dumps(body)))
        if ours.input_ids != req.input_ids or ours.sampling != s or ours.routed_experts_start_len != (
                req.routed_experts_start_len if req.return_routed_experts else 0):
            problems.append(f"local server parsed {ours} for {req}")


REFUSED = {  # bodies vLLM's GenerateRequest / SamplingParams refuse: the local server must refuse them too
    "empty": {"token_ids": [], "sampling_params": {"max_tokens": 1}},
    "negative": {"token_ids": [1, -2], "sampling_params": {"max_tokens": 1}},
    "top_p": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "top_p": 0.0}},
    "top_p_big": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "top_p": 1.5}},
    "temperature": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "temperature": -1.0}},
    "max_tokens": {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
    "no_sampling": {"token_ids": [1]},
    "ids_type": {"token_ids": ["a"], "sampling_params": {"max_tokens": 1}},
}


def check_refusals() -> dict:
    out = {}
    for name, body in REFUSED.items():
        try:
            GenerateRequest.model_validate(body)
            vllm_refuses = False
        except Exception:  # noqa: BLE001
            vllm_refuses = True
        try:
            parse_vllm_generate(body)
            ours = False
        except ValueError:
            ours = True
        out[name] = [vllm_refuses, ours]
        if vllm_refuses and not ours:
            problems.append(f"refusal: vLLM refuses {name} ({body}), the local server accepts it")
    return out


def check_response_parsing(client: VLLMClient) -> None:
    """A response built by vLLM's own classes (numpy2base64 of uint8 experts, spans, usage) through our parser."""
    experts = np.arange(5 * 4 * 2, dtype=np.uint8).reshape(5, 4, 2) % 8
    resp = GenerateTokensResponse(request_id="x", choices=[GenerateTokensChoice(
        index=0, finish_reason="stop", stop_reason=9, token_ids=[7, 8, 9],
        logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=t, logprob=lp)
                                           for t, lp in ((7, -0.5), (8, -1.25), (9, -2.0))]),
        routed_experts=numpy2base64(experts),
        weight_versions=[WeightVersionSpan(version="v1", start=0, end=1), WeightVersionSpan(version="v2", start=1, end=3)],
    )], usage=UsageInfo(prompt_tokens=3, completion_tokens=3, total_tokens=6,
                        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=2)))
    body = json.loads(resp.model_dump_json())
    req = OurRequest([1, 2, 3], SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), return_routed_experts=True)
    res = asyncio.run(client._parse_vllm(req, body))
    if (res.output_ids, res.output_logprobs, res.finish_reason.type, res.finish_reason.matched, res.weight_version,
            res.prompt_tokens, res.cached_tokens) != ([7, 8, 9], [-0.5, -1.25, -2.0], "stop", 9, "v2", 3, 2):
        problems.append(f"response: parsed {res}")
    if res.routed_experts_NLK is None or not (res.routed_experts_NLK == experts.astype(np.int32)).all():
        problems.append("response: routed experts differ from vLLM's encoding")


def check_local_response() -> None:
    """The local server's answer body validates as vLLM's GenerateTokensResponse."""
    from megatron_search.rollout.local.vllm_api import vllm_generate_response
    from megatron_search.rollout.engine.types import FinishReason, GenerateResult

    req = OurRequest([1, 2], SamplingParams(max_new_tokens=2, stop_token_ids=(5,)))
    res = GenerateResult([4, 5], [-0.1, -0.2], FinishReason("stop", matched=5), "v7", 2, 1,
                         np.zeros((3, 4, 2), dtype=np.int32))
    body = vllm_generate_response(req, res, "abc", "m")
    try:
        v = GenerateTokensResponse.model_validate(body)
        c = v.choices[0]
        if (c.token_ids, c.stop_reason, c.finish_reason, c.weight_versions[0].version, v.usage.prompt_tokens_details
                .cached_tokens) != ([4, 5], 5, "stop", "v7", 1):
            problems.append(f"local response: vLLM reads {c}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"local response: not a vLLM GenerateTokensResponse: {e}")


class Recorder(VLLMClient):
    def __init__(self):
        super().__init__("http://x")
        self.calls: list[tuple[str, str, dict]] = []

    async def _call(self, path, payload=None, method="POST"):
        from megatron_search.rollout.vllm.launcher import EXTENSION

        self.calls.append((method, path, payload))
        if path.startswith("/reset_prefix_cache"):
            return {"success": True}
        if path.startswith("/server_info"):  # the fields of vLLM's JSON config dump the client reads (checked below)
            return {"vllm_config": {"parallel_config": {"worker_extension_cls": EXTENSION},
                                    "device_config": {"device": "cuda"}}}
        if path == "/collective_rpc":
            return {"results": [{"repacked_layers": 0}, {"repacked_layers": 0}]}
        return {}


def check_worker_extension() -> None:
    """vLLM mixes --worker-extension-cls into its worker class and asserts that no attribute clashes
    (v1/worker/worker_base.py); our methods call the worker's own reload_weights and model_runner.get_model."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_search.rollout.vllm.worker_ext import MegatronSearchWorkerExtension as Ext

    ours = [a for a in dir(Ext) if not a.startswith("__")]
    checked.add("worker extension")
    for a in ours:
        if hasattr(Worker, a):
            problems.append(f"worker extension: {a} clashes with vLLM's Worker.{a}")
    if set(ours) - {"megatron_search_reload_weights", "_megatron_search_reload"}:
        problems.append(f"worker extension: unexpected attributes {ours}")
    from vllm.config import DeviceConfig, ParallelConfig
    from vllm.entrypoints.serve.dev.server_info import api_router as server_info

    # the client reads vllm_config.parallel_config.worker_extension_cls and .device_config.device of
    # /server_info?config_format=json (a pydantic dump of VllmConfig)
    for cls, name in ((ParallelConfig, "worker_extension_cls"), (DeviceConfig, "device")):
        if name not in getattr(cls, "__dataclass_fields__", {}) and name not in getattr(cls, "model_fields", {}):
            problems.append(f"server_info: {cls.__name__} has no field {name}")
    if "config_format" not in server_info.show_server_info.__code__.co_varnames:
        problems.append("server_info: no config_format query")
    if not callable(getattr(Worker, "reload_weights", None)) or not callable(getattr(GPUModelRunner, "get_model", None)):
        problems.append("worker extension: vLLM's Worker.reload_weights / GPUModelRunner.get_model are gone")


RPC_METHODS = ("reload_weights", "megatron_search_reload_weights")


def check_control_requests(routes: set) -> None:
    from urllib.parse import parse_qs, urlparse

    from vllm.v1.engine import PauseMode
    import typing

    c = Recorder()

    async def go():
        for mode in ("abort", "retract", "in_place"):
            await c.pause_generation(mode)
            await c.flush_cache()
            await c.continue_generation()
        await c.begin_weight_update()
        await c.end_weight_update()
        await c.update_weight_version("v3", abort_all_requests=True)
        await c.update_weights_from_disk("/ckpt/v3", weight_version="v3")
        await c.release_memory_occupation()
        await c.release_memory_occupation(["kv_cache"])
        await c.resume_memory_occupation(["weights"])
        await c.resume_memory_occupation()
        await c.init_weights_update_group("10.0.0.1", 29500, 1, 3)
        await c.update_weights_from_distributed(["a.weight"], ["bfloat16"], [[2, 3]])
        await c.destroy_weights_update_group()
    asyncio.run(go())
    modes = set(typing.get_args(PauseMode))
    for method, path, payload in c.calls:
        u = urlparse(path)
        q = parse_qs(u.query)
        checked.add(f"{method} {u.path}")
        if (method, u.path) not in routes:
            problems.append(f"control: {method} {u.path} is not a vLLM 0.33.0 route")
        if u.path in ("/pause", "/sleep") and not set(q.get("mode", ["abort"])) <= modes:
            problems.append(f"control: {path}: mode not in vLLM's PauseMode {modes}")
        if u.path == "/sleep" and q.get("level") != ["2"]:
            problems.append(f"control: {path}: level")
        if u.path == "/wake_up" and not set(q.get("tags", [])) <= {"weights", "kv_cache"}:
            problems.append(f"control: {path}: tags")
        if u.path == "/update_weight_version" and set(payload) != {"new_version"}:
            problems.append(f"control: {path} body {payload}")
        if u.path == "/server_info" and q.get("config_format") != ["json"]:
            problems.append(f"control: {path}: the client needs config_format=json")
        if u.path == "/collective_rpc" and not (payload["method"] in RPC_METHODS and all(
                isinstance(v, str) for v in payload.get("kwargs", {}).values())):  # vLLM passes only string kwargs
            problems.append(f"control: {path} body {payload}")
        if u.path == "/init_weight_transfer_engine":
            NCCLWeightTransferInitInfo(**payload["init_info"])  # raises on an unknown or missing field
        if u.path == "/update_weights":
            NCCLWeightTransferUpdateInfo(**payload["update_info"])
    retract = [p for _, p, _ in c.calls if p.startswith("/reset_prefix_cache")]
    # pause abort / retract / in_place, then the disk load and the distributed update (flush_cache=True)
    if retract != ["/reset_prefix_cache", "/reset_prefix_cache?reset_running_requests=true", "/reset_prefix_cache",
                   "/reset_prefix_cache", "/reset_prefix_cache"]:
        problems.append(f"control: prefix-cache resets {retract}")


def check_auth() -> int:
    """vllm_request_allowed against vLLM's middleware on every (method, path, header) case."""
    key = "k3y-" + "x" * 28
    paths = ["/inference/v1/generate", "/v1/models", "/v2/x", "/cohere/v2/chat", "/health", "/pause", "/sleep",
             "/update_weights", "/collective_rpc", "/reset_prefix_cache", "/v10", "/inferencex"]
    headers = [None, f"Bearer {key}", f"bearer {key}", f"BEARER {key}", "Bearer wrong", f"Basic {key}", f"Bearer  {key}",
               f"Bearer {key} "]
    n = 0
    for method in ("GET", "POST", "OPTIONS"):
        for path in paths:
            for h in headers:
                passed = []

                async def app(scope, receive, send):
                    passed.append(True)

                async def send(msg):
                    pass

                scope = {"type": "http", "method": method, "path": path, "root_path": "",
                         "headers": [] if h is None else [(b"authorization", h.encode())]}
                res = AuthenticationMiddleware(app, [key])(scope, None, send)
                asyncio.run(res)
                ours = vllm_request_allowed(method, path, h, key)
                n += 1
                if bool(passed) != ours:
                    problems.append(f"auth: {method} {path} {h!r}: vLLM {'passes' if passed else '401'}, ours "
                                    f"{'passes' if ours else '401'}")
    return n


def main() -> None:
    routes = vllm_routes()
    client = VLLMClient("http://x")
    check_generate_requests(client)
    refusals = check_refusals()
    check_response_parsing(client)
    check_local_response()
    check_control_requests(routes)
    check_worker_extension()
    auth_cases = check_auth()
    print(json.dumps({"vllm": vllm.__version__, "checked": sorted(checked), "problems": problems,
                      "refusals": refusals, "auth_cases": auth_cases}))


if __name__ == "__main__":
    sys.exit(main())
