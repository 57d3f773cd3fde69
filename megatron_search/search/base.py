"""The search backend interface: one query in, at most k ranked results out.

Backends (local bm25s index, SearXNG over HTTP, a commercial API later) implement
`search` (blocking) and may override `asearch` (the agent loop's path; the default runs
`search` in a worker thread so the event loop keeps serving other rollouts). A backend that
cannot answer raises `SearchBackendError`; the `search_web` tool turns that into a tool
error the model sees (and counts it as a failed execution), never a crash.
"""
from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SearchResult:
    """One hit. `doc_id` is the corpus id (local index) or the URL (web backends)."""

    title: str
    url: str
    snippet: str
    doc_id: str


class SearchBackendError(RuntimeError):
    """The backend could not answer (timeout, HTTP error, bad payload, missing index)."""


class SearchTimeout(SearchBackendError):
    """The backend did not answer in time (every attempt timed out, or the tool's call deadline passed)."""


class SearchBackend(ABC):
    """A search engine behind the `search_web` tool."""

    name: str = "backend"

    @abstractmethod
    def search(self, query: str, k: int) -> list[SearchResult]:
        """Up to k results for `query`, best first. Raises SearchBackendError on failure."""

    async def asearch(self, query: str, k: int) -> list[SearchResult]:
        """Async variant used by the agent loop; default: `search` in a worker thread."""
        return await asyncio.to_thread(self.search, query, k)

    async def aclose(self) -> None:
        """Release connections (HTTP backends); nothing to do by default."""

    def close(self) -> None:
        """Blocking twin of `aclose` for code outside an event loop."""


def read_api_key(env_var: Optional[str]) -> Optional[str]:
    """The API key held in environment variable `env_var` (None when no variable is configured).

    The key is only ever returned to the caller that sends it; never log or repr it.
    """
    if not env_var:
        return None
    key = os.environ.get(env_var)
    if not key:
        raise SearchBackendError(
            f"search.api_key_env names environment variable {env_var!r}, but it is not set (or empty)"
        )
    return key


def build_backend(cfg) -> SearchBackend:
    """The backend a `SearchConfig` names (local: load/build the index; searxng: HTTP client)."""
    if cfg.backend == "local":
        from .local import load_or_build  # start-up: bm25s + numpy (+0.12 s), every CLI command imports this package

        return load_or_build(cfg.index_dir, cfg.corpus, cfg.snippet_chars)
    if cfg.backend == "searxng":
        from .searxng import SearxngBackend  # start-up: aiohttp (+0.13 s), every CLI command imports this package

        return SearxngBackend(cfg.url, cfg.timeout_s, cfg.retries, cfg.retry_backoff_s, cfg.api_key_env,
                              cfg.max_connections)
    raise ValueError(f"search.backend: unknown backend {cfg.backend!r} (expected 'local' or 'searxng')")
