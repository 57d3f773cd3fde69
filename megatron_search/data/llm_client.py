"""OpenAI-compatible chat-completions client for data work (SGLang servers, the local engine, any
compatible endpoint).

- concurrency limit (asyncio semaphore), per-request timeout, retries with exponential backoff on
  connection errors, timeouts, HTTP 429 and 5xx (Retry-After honoured); other 4xx fail at once;
- on-disk cache keyed by the SHA-256 of the request body (plus a sample index, so n independent
  samples of one prompt are n cache entries): re-running a pipeline costs nothing twice;
- structured output: `chat_json` extracts one JSON value from the reply (code fences tolerated) and
  checks required keys, raising LLMOutputError with an excerpt of what came back;
- the API key is read from an environment variable, sent only in the Authorization header, never
  logged and never part of the cache key.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from .jsonl import atomic_write_text

log = logging.getLogger(__name__)
_RETRY_STATUS = {429, 500, 502, 503, 504}


class LLMError(RuntimeError):
    """The endpoint failed (after retries) or rejected the request."""


class LLMOutputError(ValueError):
    """The reply does not have the expected structure; the message quotes what came back."""


@dataclass
class ChatReply:
    text: str
    finish_reason: Optional[str]
    cached: bool
    usage: dict


def _excerpt(s: str, n: int = 200) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n] + "..."


def parse_json_reply(text: str, required: Optional[dict[str, type]] = None) -> Any:
    """The JSON value in `text` (bare, or inside a ```json fence, or the outermost {...}/[...])."""
    candidates = []
    fence = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fence:
        candidates.append(fence.group(1))
    candidates.append(text.strip())
    for open_c, close_c in ("{}", "[]"):
        i, j = text.find(open_c), text.rfind(close_c)
        if 0 <= i < j:
            candidates.append(text[i: j + 1])
    value, last_err = None, None
    for c in candidates:
        try:
            value = json.loads(c)
            break
        except ValueError as e:
            last_err = e
    else:
        raise LLMOutputError(f"reply is not JSON ({last_err}): {_excerpt(text)!r}")
    if required:
        if not isinstance(value, dict):
            raise LLMOutputError(f"expected a JSON object with keys {sorted(required)}, got {type(value).__name__}: "
                                 f"{_excerpt(text)!r}")
        for key, typ in required.items():
            if key not in value:
                raise LLMOutputError(f"JSON reply lacks key {key!r} (has {sorted(value)}): {_excerpt(text)!r}")
            if not isinstance(value[key], typ):
                raise LLMOutputError(f"JSON key {key!r} should be {typ.__name__}, got {type(value[key]).__name__}")
    return value


class LLMClient:
    def __init__(self, base_url: str, model: str = "default", api_key_env: Optional[str] = None,
                 concurrency: int = 8, timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 1.0,
                 cache_dir: Optional[str | os.PathLike] = None):
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self._key = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise LLMError(f"environment variable {api_key_env!r} (the API key) is not set")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._sem = asyncio.Semaphore(concurrency)
        self._session: Optional[aiohttp.ClientSession] = None
        self.http_requests = 0  # requests actually sent (cache hits excluded)

    @classmethod
    def from_config(cls, cfg, cache_dir: Optional[str] = None) -> "LLMClient":
        return cls(cfg.base_url, cfg.model, cfg.api_key_env, cfg.concurrency, cfg.timeout_s, cfg.retries,
                   cfg.backoff_s, cache_dir or cfg.cache_dir)

    def __repr__(self) -> str:  # never shows the key
        return f"LLMClient(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _cache_path(self, body: dict, sample_index: int) -> Optional[Path]:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(json.dumps([body, sample_index], sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        return self.cache_dir / key[:2] / f"{key}.json"

    async def chat(self, messages: list[dict], *, temperature: float = 0.0, max_tokens: int = 1024,
                   sample_index: int = 0, extra: Optional[dict] = None) -> ChatReply:
        """One completion. `sample_index` separates independent samples of the same request in the cache."""
        body = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        if extra:
            body.update(extra)
        path = self._cache_path(body, sample_index)
        if path is not None and path.exists():
            d = json.loads(path.read_text(encoding="utf-8"))
            return ChatReply(d["text"], d.get("finish_reason"), True, d.get("usage", {}))
        payload = await self._post(body)
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise LLMOutputError(f"not a chat-completions response: {_excerpt(json.dumps(payload))!r}") from None
        reply = ChatReply(text, choice.get("finish_reason"), False, payload.get("usage") or {})
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"text": text, "finish_reason": reply.finish_reason,
                                                "usage": reply.usage, "request": body}, ensure_ascii=False))
        return reply

    async def chat_json(self, messages: list[dict], required: Optional[dict[str, type]] = None, **kw) -> Any:
        reply = await self.chat(messages, **kw)
        return parse_json_reply(reply.text, required)

    async def _post(self, body: dict) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        last = "no attempt"
        async with self._sem:
            for attempt in range(self.retries + 1):
                delay = self.backoff_s * (2 ** attempt)
                try:
                    self.http_requests += 1
                    timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                    async with self._session.post(self.url, json=body, headers=headers, timeout=timeout) as resp:
                        text = await resp.text()
                        if resp.status == 200:
                            try:
                                return json.loads(text)
                            except ValueError:
                                raise LLMOutputError(f"{self.url}: response body is not JSON: {_excerpt(text)!r}") from None
                        last = f"HTTP {resp.status}: {_excerpt(text)}"
                        if resp.status not in _RETRY_STATUS:
                            raise LLMError(f"{self.url}: {last}")
                        retry_after = resp.headers.get("Retry-After")
                        if retry_after and retry_after.replace(".", "", 1).isdigit():
                            delay = max(delay, float(retry_after))
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    last = f"{type(e).__name__}: {e}"
                if attempt < self.retries:
                    log.warning("LLM request failed (%s); retry %d/%d in %.1fs", last, attempt + 1, self.retries, delay)
                    await asyncio.sleep(delay)
        raise LLMError(f"{self.url}: failed after {self.retries + 1} attempts ({last})")
