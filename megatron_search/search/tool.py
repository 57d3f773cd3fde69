"""The `search_web` tool: limits, broken-call classification and per-rollout accounting.

RECIPE 6 limits (from `SearchConfig`): at most `max_results` (10) results per call, queries of
at most `max_query_chars` (250) characters, at most `max_calls` (5) calls per rollout; the eval
budget protocol overrides the call limit with the budget b stated in the system prompt.

Accounting per rollout (docs/SEARCH.md has the full table):
- `calls` (c_i) counts every tool call the model emitted, broken or not; every call uses up
  one unit of the budget.
- `failed` (e_i) counts executions that failed in the environment (backend timeout, HTTP or
  index error). Those never cost the policy an effective call (c~_i = c_i - e_i).
  `failed_kinds` splits them by class (SEARCH_FAILURE_KINDS): search_timeout (the backend timed
  out, or the call ran past the tool's `call_timeout_s`) and search_error (anything else).
- `broken[kind]` counts model-caused failures, one class per call, checked in this order:
  malformed, tool_choice_none, over_budget, unknown_tool, bad_arguments (an over-long or
  empty query is bad_arguments). They stay in c~_i and appear in the broken-tool-calls metric.
Every failure returns an error text inside the tool response, so the model sees it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .base import SearchBackend, SearchBackendError, SearchResult, SearchTimeout, build_backend

log = logging.getLogger(__name__)

SEARCH_WEB = "search_web"
BROKEN_KINDS = ("malformed", "tool_choice_none", "over_budget", "unknown_tool", "bad_arguments")
SEARCH_FAILURE_KINDS = ("search_timeout", "search_error")
ToolChoice = Literal["auto", "required", "none"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call as written by the model. `parse_error` set means it could not be parsed (malformed)."""

    name: Optional[str]
    arguments: Optional[Any]
    raw: str = ""
    parse_error: Optional[str] = None


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: `text` goes inside <tool_response> for the model."""

    text: str
    ok: bool
    broken: Optional[str] = None  # one of BROKEN_KINDS when the model was at fault
    failed: bool = False  # environment failure: counts in e_i
    results: tuple[SearchResult, ...] = ()
    latency_s: float = 0.0


@dataclass
class ToolStats:
    """Per-rollout counters consumed by rewards (c_i, e_i) and eval (broken-tool-calls)."""

    calls: int = 0
    failed: int = 0
    broken: dict[str, int] = field(default_factory=lambda: {k: 0 for k in BROKEN_KINDS})
    queries: list[str] = field(default_factory=list)
    failed_kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEARCH_FAILURE_KINDS, 0))

    @property
    def broken_total(self) -> int:
        return sum(self.broken.values())

    @property
    def effective_calls(self) -> int:
        """c~_i = c_i - e_i (RECIPE 5.2)."""
        return self.calls - self.failed

    def as_dict(self) -> dict:
        return {"calls": self.calls, "failed": self.failed, "effective_calls": self.effective_calls,
                "broken_total": self.broken_total, **{f"broken_{k}": v for k, v in self.broken.items()},
                **self.failed_kinds}


def format_results(query: str, results: list[SearchResult]) -> str:
    """The tool response text for a successful search (numbered, title / URL / snippet)."""
    if not results:
        return f"No results found for query: {query}"
    blocks = [f"[{i}] {r.title}\nURL: {r.url}\n{r.snippet}" for i, r in enumerate(results, 1)]
    return "\n\n".join(blocks)


class SearchTool:
    """`search_web` over a backend, with the RECIPE 6 limits."""

    name = SEARCH_WEB

    def __init__(self, backend: SearchBackend, max_results: int = 10, max_query_chars: int = 250, max_calls: int = 5,
                 call_timeout_s: Optional[float] = None):
        if max_results <= 0 or max_query_chars <= 0 or max_calls < 0:
            raise ValueError("SearchTool: max_results and max_query_chars must be > 0, max_calls >= 0")
        if call_timeout_s is not None and not 0 < call_timeout_s < float("inf"):
            raise ValueError(f"SearchTool: call_timeout_s must be positive seconds or None, got {call_timeout_s}")
        self.backend = backend
        self.max_results = max_results
        self.max_query_chars = max_query_chars
        self.max_calls = max_calls
        self.call_timeout_s = call_timeout_s  # a whole call, retries included; None = only the backend's own limits

    @classmethod
    def from_config(cls, cfg, backend: Optional[SearchBackend] = None) -> "SearchTool":
        """Build from a `SearchConfig`; the backend too unless one is given."""
        if backend is None:
            backend = build_backend(cfg)
        return cls(backend, cfg.max_results, cfg.max_query_chars, cfg.max_calls, cfg.call_timeout_s)

    @property
    def spec(self) -> dict:
        """The OpenAI-style function schema rendered into the system prompt."""
        return {
            "type": "function",
            "function": {
                "name": SEARCH_WEB,
                "description": (
                    f"Search the web. Returns up to {self.max_results} results (title, URL, snippet). "
                    f"The query must be at most {self.max_query_chars} characters."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "the search query"}},
                    "required": ["query"],
                },
            },
        }

    def check_arguments(self, arguments: Any) -> Optional[str]:
        """Why `arguments` are invalid for search_web, or None when they are fine."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object with a 'query' string, got {type(arguments).__name__}"
        extra = sorted(set(arguments) - {"query"})
        if extra:
            return f"unexpected argument(s) {', '.join(map(repr, extra))}; search_web takes only 'query'"
        query = arguments.get("query")
        if not isinstance(query, str):
            return "missing required argument 'query' (a string)"
        if not query.strip():
            return "'query' is empty"
        if len(query) > self.max_query_chars:
            return f"'query' is {len(query)} characters long; the limit is {self.max_query_chars}. Use a shorter query"
        return None

    def session(self, budget: Optional[int] = None, tool_choice: ToolChoice = "auto") -> "ToolSession":
        """Fresh per-rollout state; `budget` (the eval's b) replaces `max_calls` when given."""
        return ToolSession(self, self.max_calls if budget is None else budget, tool_choice)


class ToolSession:
    """One rollout's tool use: classifies and executes calls, keeps `stats`."""

    def __init__(self, tool: SearchTool, budget: int, tool_choice: ToolChoice = "auto"):
        if budget < 0:
            raise ValueError(f"tool budget must be >= 0, got {budget}")
        if tool_choice not in ("auto", "required", "none"):
            raise ValueError(f"tool_choice must be 'auto', 'required' or 'none', got {tool_choice!r}")
        self.tool = tool
        self.budget = budget
        self.tool_choice = tool_choice
        self.stats = ToolStats()

    @property
    def remaining(self) -> int:
        return max(0, self.budget - self.stats.calls)

    def classify(self, call: ToolCall) -> Optional[tuple[str, str]]:
        """(broken kind, error text for the model) for the next call, or None if it may run.

        Pure with respect to the counters: it reads `stats.calls` but does not change it.
        """
        if call.parse_error is not None:
            return "malformed", f"Error: the tool call could not be parsed ({call.parse_error})."
        if self.tool_choice == "none":
            return "tool_choice_none", "Error: tool calls are disabled for this request. Answer without calling tools."
        if self.stats.calls >= self.budget:
            return "over_budget", (
                f"Error: tool budget exhausted: all {self.budget} allowed tool call(s) are used. "
                "Answer with the information you already have."
            )
        if call.name != SEARCH_WEB:
            return "unknown_tool", f"Error: unknown tool {call.name!r}. The only available tool is {SEARCH_WEB}."
        problem = self.tool.check_arguments(call.arguments)
        if problem is not None:
            return "bad_arguments", f"Error: invalid arguments for {SEARCH_WEB}: {problem}."
        return None

    def _admit(self, call: ToolCall) -> Optional[ToolResult]:
        """Count the call; a ToolResult when it is broken (no execution), else None."""
        verdict = self.classify(call)
        self.stats.calls += 1
        if verdict is None:
            self.stats.queries.append(call.arguments["query"])
            return None
        kind, text = verdict
        self.stats.broken[kind] += 1
        return ToolResult(text=text, ok=False, broken=kind)

    async def _run(self, query: str) -> ToolResult:
        start = time.perf_counter()
        limit = self.tool.call_timeout_s
        try:
            results = await asyncio.wait_for(self.tool.backend.asearch(query, self.tool.max_results), limit)
        except SearchTimeout as e:
            return self._failure(f"{e}", start, "search_timeout")
        except SearchBackendError as e:
            return self._failure(f"{e}", start, "search_error")
        except asyncio.TimeoutError as e:  # the call deadline, or a backend's own unwrapped timeout
            own = limit is None or time.perf_counter() - start < limit
            return self._failure(f"{type(e).__name__}" if own else f"no answer within {limit:g} s", start,
                                 "search_timeout")
        except Exception as e:  # a backend bug must not kill the rollout; it is still an environment failure
            log.warning("search backend %s raised %s: %s", self.tool.backend.name, type(e).__name__, e)
            return self._failure(type(e).__name__, start, "search_error")
        results = list(results)[: self.tool.max_results]
        return ToolResult(format_results(query, results), True, results=tuple(results),
                          latency_s=time.perf_counter() - start)

    def _failure(self, reason: str, start: float, kind: str) -> ToolResult:
        self.stats.failed += 1
        self.stats.failed_kinds[kind] += 1
        return ToolResult(f"Error: the search failed ({reason}). You may retry or answer with what you know.",
                          ok=False, failed=True, latency_s=time.perf_counter() - start)

    async def execute(self, call: ToolCall) -> ToolResult:
        """Classify, count and (when valid) run one call."""
        rejected = self._admit(call)
        return rejected if rejected is not None else await self._run(call.arguments["query"])

    async def execute_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        """All calls of one assistant turn, in order: admitted in order (budget), valid ones run concurrently."""
        admitted = [self._admit(c) for c in calls]
        pending = [self._run(c.arguments["query"]) for c, r in zip(calls, admitted) if r is None]
        ran = iter(await asyncio.gather(*pending))
        return [r if r is not None else next(ran) for r in admitted]
