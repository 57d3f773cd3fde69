"""The `search_web` tool and its backends (local bm25s index, SearXNG over HTTP).

Entry points: `build_backend(cfg.search)` (base.py) and `SearchTool.from_config(cfg.search)`;
`tool.session(budget, tool_choice)` gives the per-rollout accounting (docs/SEARCH.md).
"""
from __future__ import annotations

from .base import (SearchBackend, SearchBackendError, SearchResult, SearchTimeout, build_backend,
                   read_api_key)
from .tool import (BROKEN_KINDS, SEARCH_FAILURE_KINDS, SEARCH_WEB, SearchTool, ToolCall, ToolResult, ToolSession,
                   ToolStats, format_results)

__all__ = ["BROKEN_KINDS", "SEARCH_FAILURE_KINDS", "SEARCH_WEB", "SearchBackend", "SearchBackendError", "SearchResult",
           "SearchTimeout", "SearchTool", "ToolCall", "ToolResult", "ToolSession", "ToolStats", "build_backend",
           "format_results", "read_api_key"]
