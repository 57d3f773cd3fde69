"""Engine API keys: one per job, handed to servers through the environment, sent as a Bearer token.

SGLang 0.5.23 with `--api-key` (srt/utils/auth.py `decide_request_auth`, installed by
srt/entrypoints/http_server.py): every route needs `Authorization: Bearer <key>` (scheme matched
case-insensitively, key compared in constant time) except OPTIONS requests and paths starting with
/health, /ready or /metrics; a refusal is HTTP 401 `{"error": "Unauthorized"}`. With only an API key
(no admin key) its NORMAL and ADMIN_OPTIONAL levels decide alike, so that is the whole rule;
`request_allowed` is it for the local server.

SGLang reads the key from argv only (no environment variable) and logs it: `server_args={...}` at
startup and `launch_command` both carry it. SGLang servers therefore start through
`rollout/sglang/serve.py`, which takes the key from the environment (see `sglang_serve`).

The key lives in one environment variable, `rollout.api_key_env`. `job_key` reads it or generates
one (secrets.token_urlsafe) and exports it, so servers and workers started later inherit it;
`distributed.init.init_distributed` hands rank 0's key to every training rank. `SGLangClient`
created without a key reads the variable named by `use_key_env` (set from the config by
`init_distributed` and `start_engines`; default MEGATRON_SEARCH_ENGINE_KEY): the one process-wide
setting here, because clients are also built in places that are handed URLs only.
"""
from __future__ import annotations

import hmac
import os
import secrets
from typing import Optional

from megatron_search.config.rollout import DEFAULT_ENGINE_KEY_ENV

MIN_KEY_CHARS = 16  # shorter keys are refused: guessable, and redacting them would mangle logs
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang leaves these open for probes
_client_key_env = DEFAULT_ENGINE_KEY_ENV


class EngineKeyError(ValueError):
    """The configured engine key is unusable (the message names the variable, never the value)."""


def use_key_env(name: str) -> None:
    """Name the variable `SGLangClient` reads its key from when none is passed (from `rollout.api_key_env`)."""
    global _client_key_env
    _client_key_env = name


def client_key_env() -> str:
    return _client_key_env


def check_key(key: str, where: str) -> str:
    """`key` if it can be a Bearer token worth having (>= 16 visible ASCII characters); else EngineKeyError."""
    if len(key) < MIN_KEY_CHARS or not all(33 <= ord(c) < 127 for c in key):
        raise EngineKeyError(f"{where}: the engine API key must be at least {MIN_KEY_CHARS} visible ASCII characters "
                             "without spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return key


def key_from_env(name: Optional[str] = None) -> Optional[str]:
    """The key in environment variable `name` (default: the clients' variable), None when unset or empty."""
    name = name or _client_key_env
    value = os.environ.get(name)
    return check_key(value, f"${name}") if value else None


def job_key(name: str) -> str:
    """This job's key: from `$name`, or generated now and exported there (children inherit it)."""
    key = key_from_env(name)
    if key is None:
        key = secrets.token_urlsafe(32)
        os.environ[name] = key
    return key


def bearer_header(key: Optional[str]) -> dict[str, str]:
    """The Authorization header SGLang checks; empty without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def request_allowed(method: str, path: str, authorization: Optional[str], key: Optional[str]) -> bool:
    """SGLang 0.5.23's decision for a server started with `--api-key key` (and no admin key)."""
    if not key or method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES):
        return True
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode(), key.encode())
