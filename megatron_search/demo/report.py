"""What the demo's report shows beyond accuracy (issue 21): which strategy the policy follows before and
after GRPO, RL's ceiling (the SFT policy's pass@k on training prompts), and GRPO's reward and penalty
curves drawn as the write-up's figures 2-3 (RECIPE 7). Pure functions of result rows and scalars, plus
the plotting."""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

from megatron_search.data.demo_tasks import EPISODE_STRATEGIES, classify_strategy

# RECIPE 7: base reward and preference rise (figure 2); tool calls and length stay controlled and both
# penalties fall (figure 3).
FIGURES = {
    "grpo_rewards.png": ("GRPO rewards (write-up figure 2)", ("reward/r_base", "reward/preference", "reward/mean")),
    "grpo_penalties.png": ("GRPO penalties and efficiency (write-up figure 3)",
                           ("reward/pen_tool", "reward/pen_len", "reward/tool_calls")),
}


def strategy_table(rows: Sequence[dict], subjects: dict[str, str]) -> dict[str, dict[str, float]]:
    """{strategy: {"share", "accuracy"}} over eval episodes, each classified from its queries and its question's
    subject (data/demo_tasks.classify_strategy); accuracy is None for a strategy no episode followed."""
    counts: Counter = Counter()
    correct: Counter = Counter()
    for r in rows:
        if r["id"] not in subjects:
            raise KeyError(f"episode {r['id']!r} has no subject in the demo's questions")
        s = classify_strategy(list(r.get("queries") or []), subjects[r["id"]])
        counts[s] += 1
        correct[s] += r["grade"] == "CORRECT"
    n = max(1, sum(counts.values()))
    return {s: {"share": counts[s] / n, "accuracy": correct[s] / counts[s] if counts[s] else None}
            for s in EPISODE_STRATEGIES}


def pass_at_k(rows: Sequence[dict]) -> dict:
    """Share of questions answered right by at least one of their samples, and the mean per-sample accuracy,
    with k = the smallest number of samples any question has (rows beyond it are ignored, so every question
    counts the same k)."""
    by_q: dict[str, list[bool]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r["id"], r.get("sample", 0))):
        by_q[r["id"]].append(r["grade"] == "CORRECT")
    if not by_q:
        return {"k": 0, "questions": 0, "pass_at_k": None, "pass_at_1": None}
    k = min(len(v) for v in by_q.values())
    hits = [v[:k] for v in by_q.values()]
    return {"k": k, "questions": len(hits), "pass_at_k": sum(any(h) for h in hits) / len(hits),
            "pass_at_1": sum(sum(h) for h in hits) / (k * len(hits))}


def plot_curves(series: dict[str, list[tuple[int, float]]], out_dir: Path) -> list[Path]:
    """One PNG per entry of FIGURES from {tag: [(step, value)]}; tags without points are left out of a figure,
    a figure without any is not drawn. Returns the files written."""
    # start-up: matplotlib (0.3-0.5 s) and its process-wide Agg backend switch, only when curves are drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: pyplot, after the backend switch above

    written = []
    for name, (title, tags) in FIGURES.items():
        present = [t for t in tags if series.get(t)]
        if not present:
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
        for ax, tag in zip(axes[0], present):
            steps, values = zip(*series[tag])
            ax.plot(steps, values, marker=".", linewidth=1)
            ax.set_title(tag, fontsize=9)
            ax.set_xlabel("GRPO step")
            ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = Path(out_dir) / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
