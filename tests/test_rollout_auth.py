"""Engine API keys (rollout/engine/auth.py): SGLang 0.5.23's --api-key rule written out as a table, key checks,
the per-job key, and rank 0's key reaching every training rank (distributed.init.share_engine_key).

The table is SGLang's srt/utils/auth.py decide_request_auth for a server with an API key and no admin
key, read off its source; tests/_sglang_contract_check.py also compares request_allowed with that
function itself.
"""
import os
import secrets

import pytest

from megatron_search.rollout.engine import auth

KEY = "0123456789abcdef-KEY"


@pytest.mark.parametrize("method,path,header,allowed", [
    ("POST", "/generate", None, False),
    ("POST", "/generate", f"Bearer {KEY}", True),
    ("POST", "/generate", f"bearer {KEY}", True),  # the scheme is case-insensitive
    ("POST", "/generate", f"BEARER {KEY}", True),
    ("POST", "/generate", f"Bearer  {KEY}", False),  # split once on a space: the key is " KEY"
    ("POST", "/generate", f"Bearer {KEY} ", False),
    ("POST", "/generate", KEY, False),
    ("POST", "/generate", f"Basic {KEY}", False),
    ("POST", "/generate", f"Bearer {KEY[:-1]}", False),
    ("POST", "/generate", "", False),
    ("GET", "/get_model_info", None, False),
    ("POST", "/update_weights_from_tensor", None, False),
    ("GET", "/local/weights_sha256", None, False),  # not SGLang's, so guarded like any route it does not exempt
    ("GET", "/unknown", None, False),
    ("GET", "/health", None, True),
    ("GET", "/health_generate", None, True),  # a prefix match
    ("GET", "/healthz", None, True),
    ("GET", "/ready", None, True),
    ("GET", "/metrics", None, True),
    ("OPTIONS", "/generate", None, True),
])
def test_sglang_rule(method, path, header, allowed):
    assert auth.request_allowed(method, path, header, KEY) is allowed
    assert auth.request_allowed(method, path, header, None) is True  # no key: everything open, as SGLang


def test_keys_too_short_or_with_spaces_are_refused_without_echoing_them(monkeypatch):
    for bad in ("short", "x" * 15, "sixteen chars ok", "tab\there-0123456", "é" * 20):
        with pytest.raises(auth.EngineKeyError) as e:
            auth.check_key(bad, "$V")
        assert bad not in str(e.value) and "$V" in str(e.value)
    monkeypatch.setenv("MS_TEST_AUTH_KEY", "")
    assert auth.key_from_env("MS_TEST_AUTH_KEY") is None  # empty = unset


def test_job_key_is_generated_once_and_exported(monkeypatch):
    monkeypatch.delenv("MS_TEST_AUTH_KEY", raising=False)
    first = auth.job_key("MS_TEST_AUTH_KEY")
    assert len(first) == 43 and os.environ["MS_TEST_AUTH_KEY"] == first  # token_urlsafe(32)
    assert auth.job_key("MS_TEST_AUTH_KEY") == first
    monkeypatch.setenv("MS_TEST_AUTH_KEY", KEY)
    assert auth.job_key("MS_TEST_AUTH_KEY") == KEY
    assert auth.bearer_header(KEY) == {"Authorization": f"Bearer {KEY}"} and auth.bearer_header(None) == {}


def _share_rank(rank: int, nprocs: int, port: int, out_dir: str, given: str) -> None:
    import torch.distributed as dist

    from megatron_search.distributed.init import share_engine_key

    if given and rank == 1:  # a rank that already has some other value is overruled by rank 0's key
        os.environ["MS_TEST_SHARED_KEY"] = given
    else:
        os.environ.pop("MS_TEST_SHARED_KEY", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs)
    try:
        share_engine_key("MS_TEST_SHARED_KEY")
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(f"{os.environ['MS_TEST_SHARED_KEY']}\n{auth.client_key_env()}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_rank_zeros_key_reaches_every_rank(tmp_path):
    """Rank 0 generates the key (its variable unset) and every rank ends up holding it, with clients pointed at it."""
    from _mp import run_spawned

    stale = secrets.token_urlsafe(32)
    run_spawned(_share_rank, 2, str(tmp_path), stale, timeout_s=300)
    got = [(tmp_path / f"rank{r}").read_text().split("\n") for r in range(2)]
    assert got[0] == got[1] and got[0][1] == "MS_TEST_SHARED_KEY" and len(got[0][0]) == 43 and got[0][0] != stale
