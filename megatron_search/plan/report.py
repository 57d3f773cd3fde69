"""Print a plan as a table."""
from __future__ import annotations

from .memory import GIB, Plan
from .step_time import format_reference_time, format_step_time


def format_plan(plan: Plan, title: str) -> str:
    g = lambda b: f"{b / GIB:8.1f}"  # noqa: E731
    lines = [f"== {title}", f"training GPUs {plan.train_gpus}, data parallel {plan.dp}, rollout GPUs {plan.rollout_gpus}",
             f"parameters {plan.counts.total / 1e9:.1f}B (language model; vision tower carried separately)"]
    if plan.stages:
        lines.append("stage  params/GPU  weights    grads  optimizer  activations    total  (GiB)")
        for s in plan.stages:
            lines.append(
                f"{s.stage:5d} {s.params / 1e9:9.2f}B {g(s.weights)} {g(s.grads)} {g(s.optimizer)} "
                f"{g(s.activations)}    {g(s.total)}"
            )
    if plan.rollout:
        r = plan.rollout
        lines.append(
            f"rollout: {r.engines} SGLang engine(s) x {r.engine_gpus} GPUs; weights {r.weights / GIB:.1f} GiB/GPU, "
            f"KV cache {max(r.kv_budget, 0) / GIB:.1f} GiB/GPU = {r.max_tokens:,} tokens"
            + (f", GDN state {r.state_bytes_per_seq / 2**20:.1f} MiB/sequence" if r.state_bytes_per_seq else "")
        )
    if plan.moments:
        peak = max(plan.moments, key=lambda m: m.total)
        lines.append(f"colocated peak moment: '{peak.moment.name}' on stage {peak.stage}, {peak.total / GIB:.1f} GiB per "
                     "GPU (" + ", ".join(f"{h} {b / GIB:.1f}" for h, b in peak.parts.items()) + ")")
        worst: dict[str, object] = {}
        for m in plan.moments:
            if m.moment.name not in worst or m.total > worst[m.moment.name].total:
                worst[m.moment.name] = m
        lines.append("colocated moments (GiB per GPU, each on its busiest stage): " + "; ".join(
            f"{name} {m.total / GIB:.1f}" for name, m in worst.items()))
    if plan.checkpoint is not None:
        from .checkpoint import format_checkpoint  # start-up: as memory.py imports it (plan/checkpoint.py imports memory)

        lines.append(format_checkpoint(plan.checkpoint))
    if plan.step_time is not None:
        lines.append(format_step_time(plan.step_time))
    if plan.references is not None:
        lines.append(format_reference_time(plan.references))
    if plan.sync is not None:
        from .weight_sync import format_sync_report  # start-up: as in memory.py, only with a sync report

        lines.append(format_sync_report(plan.sync))
    if plan.fits:
        lines.append("FITS")
    else:
        lines.append("DOES NOT FIT:")
        lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)
