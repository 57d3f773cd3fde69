"""Ground-truth check for the embedded world: which entities satisfy a question plan under the
world's true facts. Used as an extra filter when the world is known, and by tests; the solvers
never see it."""
from __future__ import annotations

from ..world import World
from .question import QuestionPlan


def world_answers(world: World, plan: QuestionPlan) -> set[str]:
    """Names of every entity that satisfies the nested description (existential semantics)."""
    types = plan.types()
    cands = {f.subject for f in world.facts
             if f.literal and f.relation == plan.anchor_attribute and f.object == plan.anchor_value
             and world.entities[f.subject].type == types[-1]}
    for link in reversed(plan.links):
        nxt = set()
        for f in world.facts:
            if f.literal or f.relation != link.relation:
                continue
            if link.direction == "fwd" and f.object in cands:
                nxt.add(f.subject)
            elif link.direction == "inv" and f.subject in cands:
                nxt.add(f.object)
        cands = nxt
    return {world.name(e) for e in cands}
