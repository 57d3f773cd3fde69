"""The `search_web` tool and its backends (local bm25s index, SearXNG over HTTP).

Entry points: `build_backend(cfg.search)` and `SearchTool.from_config(cfg.search)`;
`tool.session(budget, tool_choice)` gives the per-rollout accounting (docs/SEARCH.md).
"""
from __future__ import annotations

from .base import SearchBackend, SearchBackendError, SearchResult, SearchTimeout, read_api_key
from .tool import (BROKEN_KINDS, SEARCH_FAILURE_KINDS, SEARCH_WEB, SearchTool, ToolCall, ToolResult, ToolSession,
                   ToolStats, format_results)


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


__all__ = ["BROKEN_KINDS", "SEARCH_FAILURE_KINDS", "SEARCH_WEB", "SearchBackend", "SearchBackendError", "SearchResult",
           "SearchTimeout", "SearchTool", "ToolCall", "ToolResult", "ToolSession", "ToolStats", "build_backend",
           "format_results", "read_api_key"]
