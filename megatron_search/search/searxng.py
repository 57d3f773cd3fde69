"""HTTP search backends: a generic JSON-over-HTTP base and the self-hosted SearXNG API.

`HTTPSearchBackend` owns timeouts, retries and error reporting; a concrete API only says how
to build the request and how to read the JSON reply. A commercial API plugs in the same way
(subclass, read its key with `read_api_key(config.api_key_env)` and put it in `headers`); the
key lives only in the request headers, never in repr, logs or error messages.
"""
from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from typing import Any, Optional

import aiohttp

from .base import SearchBackend, SearchBackendError, SearchResult, SearchTimeout, read_api_key

# Status codes worth retrying: rate limiting and server-side failures.
_RETRY_STATUS = {429, 500, 502, 503, 504}


class HTTPSearchBackend(SearchBackend):
    """GET a JSON search API with a total timeout per attempt and exponential back-off retries."""

    name = "http"

    def __init__(self, base_url: str, timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5,
                 api_key_env: Optional[str] = None, max_connections: int = 100):
        if max_connections < 1:
            raise ValueError(f"{type(self).__name__}: max_connections must be >= 1, got {max_connections}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_connections = max_connections  # requests in flight; more wait for a slot before their timeout starts
        self.retries = retries
        self.backoff_s = backoff_s
        self.api_key_env = api_key_env
        self._api_key = read_api_key(api_key_env)
        self._session: Optional[aiohttp.ClientSession] = None
        self._session_loop: Optional[asyncio.AbstractEventLoop] = None
        self._slots: Optional[asyncio.Semaphore] = None

    def __repr__(self) -> str:  # never shows the key itself
        return f"{type(self).__name__}(base_url={self.base_url!r}, api_key_env={self.api_key_env!r})"

    # --- what a concrete API defines -------------------------------------------------------
    @abstractmethod
    def request(self, query: str, k: int) -> tuple[str, dict[str, str], dict[str, str]]:
        """(url, query parameters, headers) for one search."""

    @abstractmethod
    def parse(self, payload: Any, k: int) -> list[SearchResult]:
        """Results from the decoded JSON reply; raise SearchBackendError if it is malformed."""

    # --- transport ---------------------------------------------------------------------------
    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # the pool is unbounded; `_slots` bounds requests in flight, so time spent queued is not in the timeout
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._session_loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._session

    async def _once(self, session: aiohttp.ClientSession, slots, query: str, k: int
                    ) -> tuple[Optional[list], str, bool, bool]:
        """One attempt once a slot is free: (results or None, error text, retryable, timed out)."""
        url, params, headers = self.request(query, k)
        try:
            async with slots, session.get(url, params=params, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    return None, f"HTTP {resp.status}", resp.status in _RETRY_STATUS, False
                try:
                    payload = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    return None, "reply is not JSON", False, False
        except asyncio.TimeoutError:
            return None, f"timed out after {self.timeout_s:g} s", True, True
        except aiohttp.ClientError as e:
            return None, f"connection failed ({type(e).__name__})", True, False
        return self.parse(payload, k), "", False, False

    async def _search_with(self, session: aiohttp.ClientSession, slots, query: str, k: int) -> list[SearchResult]:
        error, timed_out = "", False
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            results, error, retryable, timed_out = await self._once(session, slots, query, k)
            if results is not None:
                return results[:k]
            if not retryable:
                break
        error_cls = SearchTimeout if timed_out else SearchBackendError  # the last attempt decides the class
        raise error_cls(f"{self.name} search at {self.base_url} failed: {error} ({attempt + 1} attempt(s))")

    async def asearch(self, query: str, k: int) -> list[SearchResult]:
        session = self._client()
        return await self._search_with(session, self._slots, query, k)

    def search(self, query: str, k: int) -> list[SearchResult]:
        """Blocking search for code outside an event loop (own short-lived connection pool)."""
        async def run() -> list[SearchResult]:
            async with aiohttp.ClientSession() as session:
                return await self._search_with(session, contextlib.nullcontext(), query, k)
        return asyncio.run(run())

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


class SearxngBackend(HTTPSearchBackend):
    """A self-hosted SearXNG instance: `GET /search?q=..&format=json` (JSON output enabled in settings)."""

    name = "searxng"

    def request(self, query: str, k: int) -> tuple[str, dict[str, str], dict[str, str]]:
        headers = {"Accept": "application/json"}
        if self._api_key:  # e.g. a reverse proxy in front of SearXNG that wants a bearer token
            headers["Authorization"] = f"Bearer {self._api_key}"
        return f"{self.base_url}/search", {"q": query, "format": "json"}, headers

    def parse(self, payload: Any, k: int) -> list[SearchResult]:
        if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
            raise SearchBackendError(f"searxng at {self.base_url}: reply has no 'results' list")
        out = []
        for item in payload["results"]:
            if not isinstance(item, dict) or not item.get("url"):
                continue
            url = str(item["url"])
            out.append(SearchResult(str(item.get("title") or url), url, str(item.get("content") or ""), url))
            if len(out) == k:
                break
        return out
