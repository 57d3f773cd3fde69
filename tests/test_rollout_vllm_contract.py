"""Contract tests against vLLM 0.33.0's own code (tests/_vllm_contract_check.py, in a child process): every request
VLLMClient sends is one vLLM's models accept with the meaning we intend (each key a declared field of its
GenerateRequest / SamplingParams, values parsed back equal, max_tokens seen as provided), every route it calls is in
vLLM's route tables with that method, the pause/sleep modes are vLLM's PauseMode, /collective_rpc kwargs are strings
(vLLM passes only those), the weight-transfer bodies construct vLLM's NCCL init/update info classes; a response built
by vLLM's own classes (numpy2base64 of uint8 experts, weight-version spans, usage details) parses to the values
put in; the local server's answer validates as vLLM's GenerateTokensResponse and it refuses every body vLLM refuses;
and its key rule decides as vLLM's AuthenticationMiddleware on 288 cases.

vLLM comes from the sources scripts/fetch_vllm_contract.sh extracts into .cache/ (`make test` fetches them; the 336 MB
wheel is not part of scripts/install.sh --dev unless MS_VLLM_CONTRACT=1), never from an installed vLLM (a user's
own version would be checked instead of 0.33.0), beside the SGLang contract copy for the pure modules they share.
Without the sources the test is skipped and says so.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
CONTRACT = Path(os.environ.get("MS_VLLM_CONTRACT_PATH", HERE.parent / ".cache" / "vllm-contract-0.33.0"))
SGLANG_CONTRACT = Path(os.environ.get("MS_SGLANG_CONTRACT_PATH", HERE.parent / ".cache" / "sglang-contract-0.5.23"))


@pytest.mark.skipif(not (CONTRACT / "vllm" / "_version.py").exists(),
                    reason="vLLM 0.33.0 sources absent: run scripts/fetch_vllm_contract.sh (make test does)")
def test_vllm_client_and_local_server_match_vllms_own_types():
    assert (SGLANG_CONTRACT / "sglang").is_dir(), f"{SGLANG_CONTRACT} is missing: run scripts/fetch_sglang_contract.sh"
    path = os.pathsep.join(p for p in (str(CONTRACT), str(SGLANG_CONTRACT), str(HERE.parent),
                                       os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_contract_check.py")], cwd=HERE.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["vllm"] == "0.33.0"
    assert result["problems"] == []
    assert set(result["checked"]) == {
        "POST /inference/v1/generate", "POST /abort_requests", "POST /collective_rpc", "POST /pause", "POST /resume",
        "POST /reset_prefix_cache", "POST /sleep", "POST /release_kv_cache_memory", "POST /wake_up",
        "POST /start_weight_update", "POST /finish_weight_update", "POST /update_weight_version",
        "POST /init_weight_transfer_engine", "POST /update_weights", "POST /shutdown_weight_transfer_engine",
        "GET /server_info", "worker extension"}
    assert all(v == [True, True] for v in result["refusals"].values()) and len(result["refusals"]) == 8
    assert result["auth_cases"] == 3 * 12 * 8
