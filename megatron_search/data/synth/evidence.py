"""Evidence gathered from search results: claims per document, support counted by distinct sites.

"Confirmed by several sources" means a claim is stated by documents on >= min_support distinct
hosts. A wrong value that one forum post asserts therefore never outweighs a confirmed fact.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Protocol
from urllib.parse import urlparse

from .extract import Claim, extract_claims


class SearchLike(Protocol):
    def search(self, query: str, k: int) -> list[Any]: ...  # objects with title, url, snippet, doc_id


class Evidence:
    """Claims extracted from every search result seen so far (one solver or one pipeline run)."""

    def __init__(self, search: SearchLike, k: int, max_query_chars: int = 250,
                 extractor: Callable[[str], list[Claim]] = extract_claims):
        self._search = search
        self._extract = extractor
        self.k = k
        self.max_query_chars = max_query_chars
        self.calls: list[str] = []
        self.doc_host: dict[str, str] = {}
        self.doc_claims: dict[str, list[Claim]] = {}
        self._hosts_by_claim: dict[Claim, set[str]] = defaultdict(set)
        self._by_subject: dict[str, set[Claim]] = defaultdict(set)
        self._by_object: dict[str, set[Claim]] = defaultdict(set)

    def query(self, q: str) -> list[str]:
        """Run one search, extract claims from the snippets; returns the doc ids returned."""
        q = q[: self.max_query_chars]
        self.calls.append(q)
        ids = []
        for r in self._search.search(q, self.k):
            ids.append(r.doc_id)
            if r.doc_id in self.doc_claims:
                continue
            host = urlparse(r.url).netloc or r.url
            claims = self._extract(r.snippet)
            self.doc_host[r.doc_id] = host
            self.doc_claims[r.doc_id] = claims
            for c in claims:
                self._hosts_by_claim[c].add(host)
                self._by_subject[c.subject].add(c)
                if not c.literal:
                    self._by_object[c.object].add(c)
        return ids

    def support(self, claim: Claim) -> int:
        return len(self._hosts_by_claim.get(claim, ()))

    def claims_about(self, name: str) -> set[Claim]:
        return self._by_subject.get(name, set()) | self._by_object.get(name, set())

    def confirmed(self, claim: Claim, min_support: int) -> bool:
        """Stated on >= min_support hosts, and no other value of the same (subject, literal attribute)
        is at least as well supported."""
        s = self.support(claim)
        if s < min_support:
            return False
        if claim.literal:
            for other in self._by_subject.get(claim.subject, ()):
                if other.relation == claim.relation and other != claim and self.support(other) >= s:
                    return False
        return True

    def entity_type(self, name: str, min_support: int) -> str | None:
        types = [c for c in self._by_subject.get(name, ()) if c.relation == "is_a" and self.support(c) >= min_support]
        return max(types, key=self.support).object if types else None

    def filter(self, pred: Callable[[Claim], bool]) -> Iterable[Claim]:
        return (c for c in self._hosts_by_claim if pred(c))
