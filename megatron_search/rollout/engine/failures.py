"""Why a rollout was lost: one class per failure, counted for the caller (GRPO logs the counts).

A rollout either finishes, as a `Rollout` with a stop reason (agent.py), or is lost to an
exception, which `classify` maps to one of FAILURE_KINDS:

    engine_error        the engine answered with an error: HTTP status >= 400, `success: false`,
                        or an in-process engine refused the request (EngineError)
    engine_unreachable  no complete answer: connection refused, reset or dropped, body cut short
    engine_timeout      no answer within the client's request timeout
    malformed_reply     a 200 answer that is not a valid reply: not JSON, wrong types, lengths that
                        disagree, non-finite logprobs, routed experts that do not fit
    internal            anything else (a bug on our side; logged with its traceback)

Search failures never lose a rollout: the tool answers the model with an error text and the
rollout goes on; they are counted per rollout in `Rollout.search_failures` (search/tool.py's
SEARCH_FAILURE_KINDS: search_timeout, search_error).
"""
from __future__ import annotations

import logging
from typing import Iterable

from megatron_search.rollout.engine.base import EngineError, EngineTimeout, EngineUnreachable, MalformedReply

log = logging.getLogger(__name__)

FAILURE_KINDS = ("engine_error", "engine_unreachable", "engine_timeout", "malformed_reply", "internal")


def classify(exc: BaseException) -> str:
    """The failure class of an exception a rollout raised (most specific engine class first)."""
    for cls, kind in ((MalformedReply, "malformed_reply"), (EngineTimeout, "engine_timeout"),
                      (EngineUnreachable, "engine_unreachable"), (EngineError, "engine_error")):
        if isinstance(exc, cls):
            return kind
    return "internal"


class RolloutFailed(Exception):
    """A lost rollout: its task's position in the batch, the failure class and the exception behind it."""

    def __init__(self, index: int, cause: BaseException):
        self.index = index
        self.kind = classify(cause)
        self.cause = cause
        super().__init__(f"rollout {index} lost ({self.kind}): {type(cause).__name__}: {cause}")

    @classmethod
    def wrap(cls, index: int, cause: BaseException) -> "RolloutFailed":
        failed = cls(index, cause)
        if failed.kind == "internal":
            log.error("rollout %d raised an unexpected %s", index, type(cause).__name__, exc_info=cause)
        return failed


def failure_counts(results: Iterable[object]) -> dict[str, int]:
    """Lost rollouts per class over a result list: `RolloutFailed`s by their kind, other exceptions classified,
    anything else (a Rollout) skipped. Every class is present, zeros included."""
    counts = dict.fromkeys(FAILURE_KINDS, 0)
    for r in results:
        if isinstance(r, BaseException):
            counts[r.kind if isinstance(r, RolloutFailed) else classify(r)] += 1
    return counts
