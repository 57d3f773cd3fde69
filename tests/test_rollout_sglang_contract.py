"""Contract tests against sglang's own code (sglang 0.5.23's pure-Python modules, which `scripts/install.sh --dev`
puts in .cache/sglang-contract-0.5.23 without its GPU dependencies, never into the environment; only this
test's child process has that folder on its path, ahead of any SGLang the user installed): every request our client sends is one
SGLang's server accepts (its request types, every key a known field, generate normalised and its
sampling params verified, each TP rank's tensor payload opened by SGLang's serializer), and our
weight-update group meets the one SGLang's init_custom_process_group creates. The local server's API-key
rule decides as sglang's decide_request_auth on every route it serves (levels read from SGLang's
http_server.py); --api-key is SGLang's only way to take the key and SGLang logs it, which is why
SGLang starts through rollout/sglang/serve.py.

The check runs in a child process (tests/_sglang_contract_check.py): importing sglang sets
environment variables and patches transformers, which must not leak into the rest of the suite.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
CONTRACT = Path(os.environ.get("MS_SGLANG_CONTRACT_PATH", HERE.parent / ".cache" / "sglang-contract-0.5.23"))
ENDPOINTS = {
    "/generate", "/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/update_weights_from_disk", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
}


def test_client_requests_and_rendezvous_are_sglangs_own():
    assert (CONTRACT / "sglang").is_dir(), f"{CONTRACT} is missing: run scripts/fetch_sglang_contract.sh"
    path = os.pathsep.join(p for p in (str(CONTRACT), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(HERE / "_sglang_contract_check.py")], cwd=HERE.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sglang"] == "0.5.23"
    assert set(result["checked"]) == ENDPOINTS
    assert result["problems"] == []
    assert result["rendezvous_equal"] is True and result["engine_exit"] == 0
    assert result["auth_mismatches"] == [] and result["auth_cases"] == 23 * 4 * 12
    levels = result["auth_levels"]
    assert set(levels.values()) <= {"NORMAL", "ADMIN_OPTIONAL"}  # no ADMIN_FORCE route: a 401 is the only refusal
    assert levels["/update_weights_from_tensor"] == levels["/update_weights_from_distributed"] == "ADMIN_OPTIONAL"
    # ours only (and 0.5.23 answers weight_version in /get_model_info, not at /get_weight_version): guarded as NORMAL
    assert result["local_routes_sglang_lacks"] == ["/get_weight_version", "/local/memory", "/local/weights_sha256",
                                                   "/no_such_route"]
    assert result["api_key_flag"] and result["sglang_logs_key"] and result["api_key_env_vars"] == []
    # our launch line through SGLang's parser (deterministic inference: where 0.5.23 honours sampling_seed)
    assert result["launch_fields"] == {
        "enable_deterministic_inference": True, "enable_memory_saver": True, "enable_return_routed_experts": True,
        "skip_tokenizer_init": True, "random_seed": 5, "weight_version": "7", "base_gpu_id": 2,
        "context_length": 4096, "mem_fraction_static": 0.8, "port": 30011}
