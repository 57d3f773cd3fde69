"""search_web tool: RECIPE 6 limits, budget enforcement at b = 0, 1, 5, broken classes, c/e accounting."""
import asyncio

import pytest

from megatron_search.search import (BROKEN_KINDS, SEARCH_FAILURE_KINDS, SearchBackend, SearchBackendError,
                                    SearchResult, SearchTimeout, SearchTool, ToolCall, format_results)
from megatron_search.search.local import LocalSearchBackend


class CountingBackend(SearchBackend):
    """Returns 25 numbered results (more than the 10 allowed) and records the queries it saw."""

    def __init__(self, fail_with=None):
        self.queries = []
        self.fail_with = fail_with

    def search(self, query, k):
        self.queries.append((query, k))
        if self.fail_with is not None:
            raise self.fail_with
        return [SearchResult(f"t{i}", f"https://e/{i}", f"s{i}", str(i)) for i in range(25)]


def call(query="capital of France"):
    return ToolCall("search_web", {"query": query})


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_enforcement(budget):
    backend = CountingBackend()
    session = SearchTool(backend).session(budget=budget)
    results = run(session.execute_all([call(f"q{i}") for i in range(budget + 2)]))
    assert [r.ok for r in results] == [True] * budget + [False, False]
    assert all(r.broken == "over_budget" and "budget" in r.text for r in results[budget:])
    assert [q for q, _ in backend.queries] == [f"q{i}" for i in range(budget)]  # over-budget calls never run
    assert session.stats.calls == budget + 2 and session.stats.failed == 0
    assert session.stats.broken["over_budget"] == 2 and session.stats.broken_total == 2
    assert session.remaining == 0


def test_default_budget_is_max_calls_and_results_are_capped():
    backend = CountingBackend()
    tool = SearchTool(backend, max_results=10, max_calls=5)
    session = tool.session()
    results = [run(session.execute(call(f"q{i}"))) for i in range(6)]
    assert [r.ok for r in results] == [True] * 5 + [False]
    assert all(k == 10 for _, k in backend.queries)  # the backend is asked for at most 10
    assert len(results[0].results) == 10
    assert results[0].text.startswith("[1] t0\nURL: https://e/0\ns0\n\n[2] t1")


def test_over_long_query_is_bad_arguments_and_never_runs():
    backend = CountingBackend()
    session = SearchTool(backend, max_query_chars=250).session()
    ok = run(session.execute(call("x" * 250)))
    long = run(session.execute(call("x" * 251)))
    assert ok.ok and not long.ok
    assert long.broken == "bad_arguments" and "251 characters" in long.text and "250" in long.text
    assert len(backend.queries) == 1
    assert session.stats.calls == 2 and session.stats.failed == 0 and session.stats.effective_calls == 2


@pytest.mark.parametrize("tc, kind", [
    (ToolCall(None, None, "<tool_call>{", "invalid JSON"), "malformed"),
    (ToolCall("browse", {"url": "x"}), "unknown_tool"),
    (ToolCall("search_web", {}), "bad_arguments"),
    (ToolCall("search_web", {"query": 3}), "bad_arguments"),
    (ToolCall("search_web", {"query": "   "}), "bad_arguments"),
    (ToolCall("search_web", {"query": "a", "k": 3}), "bad_arguments"),
    (ToolCall("search_web", '{"query": "a"}'), "bad_arguments"),
])
def test_each_broken_class_is_detected_and_shown_to_the_model(tc, kind):
    session = SearchTool(CountingBackend()).session()
    result = run(session.execute(tc))
    assert result.broken == kind and result.text.startswith("Error:") and not result.ok
    assert session.stats.broken[kind] == 1 and session.stats.broken_total == 1 and session.stats.calls == 1


def test_tool_choice_none_rejects_every_call():
    backend = CountingBackend()
    session = SearchTool(backend).session(tool_choice="none")
    results = run(session.execute_all([call(), ToolCall("other", {})]))
    assert [r.broken for r in results] == ["tool_choice_none", "tool_choice_none"]
    assert backend.queries == []


def test_classification_order_malformed_then_tool_choice_then_budget():
    session = SearchTool(CountingBackend()).session(budget=0, tool_choice="none")
    assert session.classify(ToolCall(None, None, "", "bad"))[0] == "malformed"
    assert session.classify(ToolCall("nope", {}))[0] == "tool_choice_none"
    session = SearchTool(CountingBackend()).session(budget=0)
    assert session.classify(ToolCall("nope", {}))[0] == "over_budget"
    assert set(BROKEN_KINDS) == {"malformed", "unknown_tool", "bad_arguments", "tool_choice_none", "over_budget"}


@pytest.mark.parametrize("error", [SearchBackendError("searxng at http://x failed: HTTP 500"), RuntimeError("bug")])
def test_backend_failure_is_a_tool_error_and_counts_e(error):
    session = SearchTool(CountingBackend(fail_with=error)).session()
    results = run(session.execute_all([call("a"), call("b")]))
    assert all(r.failed and not r.ok and r.broken is None and r.text.startswith("Error: the search failed")
               for r in results)
    assert session.stats.calls == 2 and session.stats.failed == 2 and session.stats.effective_calls == 0
    assert session.stats.broken_total == 0


class StuckBackend(SearchBackend):
    """Never answers a query that starts with 'stuck'; raises its own timeout for 'late'."""

    def search(self, query, k):
        raise AssertionError("the agent loop uses asearch")

    async def asearch(self, query, k):
        if query.startswith("stuck"):
            await asyncio.Event().wait()
        if query.startswith("late"):
            raise SearchTimeout("searxng at http://x failed: timed out after 10 s (3 attempt(s))")
        return [SearchResult("t", "u", "s", "d")]


def test_search_failures_are_classified_and_a_stuck_backend_hits_the_call_deadline():
    session = SearchTool(StuckBackend(), call_timeout_s=0.2).session(budget=5)
    calls = [call("stuck 1"), call("late 1"), call("fine"), call("stuck 2")]
    results = run(session.execute_all(calls))
    assert [r.ok for r in results] == [False, False, True, False]
    assert "no answer within 0.2 s" in results[0].text and "timed out after 10 s" in results[1].text
    assert session.stats.failed == 3 and session.stats.failed_kinds == {"search_timeout": 3, "search_error": 0}
    bad = SearchTool(CountingBackend(fail_with=SearchBackendError("HTTP 500"))).session()
    run(bad.execute(call()))
    assert bad.stats.failed_kinds == {"search_timeout": 0, "search_error": 1}
    assert set(SEARCH_FAILURE_KINDS) == set(bad.stats.failed_kinds)
    with pytest.raises(ValueError, match="call_timeout_s"):
        SearchTool(StuckBackend(), call_timeout_s=0)


def test_execute_all_keeps_order_with_mixed_calls():
    docs = [{"id": "a", "title": "Alpha", "url": "u/a", "text": "alpha particles"},
            {"id": "b", "title": "Beta", "url": "u/b", "text": "beta decay"}]
    session = SearchTool(LocalSearchBackend.from_docs(docs), max_calls=3).session()
    calls = [call("beta decay"), ToolCall("nope", {}), call("alpha"), call("beta")]
    results = run(session.execute_all(calls))
    assert [r.results[0].doc_id if r.ok else r.broken for r in results] == ["b", "unknown_tool", "a", "over_budget"]
    assert session.stats.as_dict()["calls"] == 4 and session.stats.queries == ["beta decay", "alpha"]


def test_format_results_without_hits_names_the_query():
    assert format_results("zzz", []) == "No results found for query: zzz"


def test_spec_is_the_openai_function_schema():
    spec = SearchTool(CountingBackend(), max_results=7, max_query_chars=99).spec
    assert spec["type"] == "function" and spec["function"]["name"] == "search_web"
    assert spec["function"]["parameters"]["required"] == ["query"]
    assert "7 results" in spec["function"]["description"] and "99 characters" in spec["function"]["description"]


def test_bad_budget_and_tool_choice_are_rejected():
    tool = SearchTool(CountingBackend())
    with pytest.raises(ValueError, match="budget"):
        tool.session(budget=-1)
    with pytest.raises(ValueError, match="tool_choice"):
        tool.session(tool_choice="sometimes")
