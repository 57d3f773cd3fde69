"""Run outputs: report.json, report.md, PNG plots and TensorBoard scalars.

Plots: accuracy_vs_budget.png (one panel per benchmark, one line per model/checkpoint, x = b)
and accuracy_vs_cost.png (one panel per benchmark, x = cents per query at each b of a model
that has a price, one line per model). TensorBoard: one run per model under tb/<model>, scalars
`<benchmark>/accuracy|mean_tool_calls|tokens_in|tokens_out|cents_per_query` at step b.

The write-up's reference points (references.py) are placed beside ours for the benchmarks both have:
as "write-up: <model>" rows in the markdown tables and as unconnected hollow markers in the plots
(two points per model are not a curve). They stay out of the curve, report.json's "budget_curve" and
TensorBoard; report.json keeps them under "references".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from torch.utils.tensorboard import SummaryWriter

from megatron_search.data.jsonl import atomic_write_json, atomic_write_text

from .cost import Price, cents_per_query
from .references import WRITE_UP, References, references_from_dict


def add_costs(curve: dict, prices: dict[str, Price]) -> None:
    """Write `cents_per_query` (and the price row used) into each point of models that have a price."""
    for model, benches in curve.items():
        price = prices.get(model)
        for points in benches.values():
            for s in points.values():
                s["cents_per_query"] = None if price is None else cents_per_query(
                    s["mean_tokens_in"], s["mean_tokens_out"], price)
                s["price"] = None if price is None else price.name


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else (f"{v:.3g}" if isinstance(v, float) else str(v))


def _cell(accuracy: Optional[float], cents: Optional[float]) -> str:
    if accuracy is None:
        return "-"
    return _fmt(accuracy, True) + ("" if cents is None else f" / {cents:.2f}c")


def markdown(report: dict) -> str:
    """The human summary: one comparison table per benchmark (write-up rows beside ours), then the
    deployment metrics, the prices and the write-up's reference points."""
    lines = [f"# Eval run: {report['run']}", ""]
    curve = report["budget_curve"]
    refs = references_from_dict(report.get("references"))
    benches = sorted({b for m in curve.values() for b in m})
    for bench in benches:
        lines += [f"## {bench}: accuracy (%) / cents per query by tool budget b", ""]
        ref_pts = [p for p in (refs.points if refs else ()) if p.benchmark == bench]
        budgets = sorted({b for m in curve.values() for b in m.get(bench, {})} | {p.budget for p in ref_pts})
        lines.append("| model | " + " | ".join(f"b={b}" for b in budgets) + " |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        for model, m in curve.items():
            pts = m.get(bench, {})
            cells = [_cell(pts[b]["accuracy"], pts[b].get("cents_per_query")) if b in pts else "-" for b in budgets]
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
        for label in dict.fromkeys(p.label for p in ref_pts):
            by_b = {p.budget: p for p in ref_pts if p.label == label}
            cells = [_cell(by_b[b].accuracy, by_b[b].cents_per_query) if b in by_b else "-" for b in budgets]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if ref_pts:
            lines += ["", f"Rows `{WRITE_UP}: ...` are the write-up's reported figures (its models, the full set, "
                      "its grader and prices), not results of this run; see \"Write-up reference points\"."]
        if refs and bench in refs.missing:
            lines += ["", f"No write-up figures for {bench}: {refs.missing[bench]}."]
        protocols = sorted({p for m in curve.values() for s in m.get(bench, {}).values()
                            for p in s.get("protocols", [])})
        graded = f" (graded by: {', '.join(protocols)})" if protocols else ""
        lines += ["", f"### {bench}: grades, tool calls and tokens per b{graded}", "",
                  "| model | b | n | correct | not attempted | acc. given attempted | F1 | token F1 | calls | tokens in | tokens out | judge malformed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for model, m in curve.items():
            for b, s in sorted(m.get(bench, {}).items()):
                lines.append(f"| {model} | {b} | {s['n']} | {_fmt(s['correct'], True)} | {_fmt(s['not_attempted'], True)} | "
                             f"{_fmt(s['accuracy_given_attempted'], True)} | {_fmt(s['f1'], True)} | "
                             f"{_fmt(s['token_f1'], True)} | {s['mean_tool_calls']:.2f} | {s['mean_tokens_in']:.0f} | "
                             f"{s['mean_tokens_out']:.0f} | {s['judge_malformed']} |")
        lines.append("")
    dep = report.get("deployment", {})
    if dep:
        lines += ["## Deployment metrics", "", "| model | metric | value |", "|---|---|---|"]
        for model, d in dep.items():
            if "broken_tool_calls" in d:
                btc = d["broken_tool_calls"]
                lines.append(f"| {model} | broken tool calls / call (all classes) | {_fmt(btc['broken_total_rate'], True)}% |")
                for k, v in btc["rate_per_call"].items():
                    lines.append(f"| {model} | broken: {k} | {_fmt(v, True)}% |")
            for bench, s in d.get("standard", {}).items():
                lines.append(f"| {model} | {bench}: accuracy, no stated budget (<= max_calls calls) | "
                             f"{_fmt(s['accuracy'], True)}% ({s['mean_tool_calls']:.2f} calls, n={s['n']}) |")
            if "tool_choice_none" in d:
                lines.append(f"| {model} | tool_choice=none episodes that called a tool | "
                             f"{_fmt(d['tool_choice_none']['episodes_calling'], True)}% |")
            if "abstention" in d:
                ab = d["abstention"]
                lines.append(f"| {model} | abstention (evidence withheld): declined | {_fmt(ab['abstention_rate'], True)}% |")
                lines.append(f"| {model} | abstention (evidence withheld): no final answer | {_fmt(ab['no_answer'], True)}% |")
            if "language_mismatch" in d:
                lm = d["language_mismatch"]
                lines.append(f"| {model} | language mismatch ({lm['determined']} determined) | {_fmt(lm['mismatch_rate'], True)}% |")
            if "sbs" in d:
                lines.append(f"| {model} | sbs vs {d['sbs']['baseline']} | {d['sbs']['sbs']:.3f} |")
        lines.append("")
    prices = report.get("prices", {})
    if prices:
        lines += ["## Prices used", "", "| model | price row | USD/1M in | USD/1M out | date | source | note |",
                  "|---|---|---|---|---|---|---|"]
        for model, p in prices.items():
            lines.append(f"| {model} | {p['name']} | {p['input_usd_per_1m']} | {p['output_usd_per_1m']} | {p['date']} | "
                         f"{p['source']} | {p.get('note') or ''} |")
        lines.append("")
    if refs and refs.points:
        src = refs.source
        lines += ["## Write-up reference points (not ours)", "",
                  f"{src.get('publisher', '')}, \"{src.get('title', '')}\", {src.get('date', '')}: {src['url']}"
                  + (f" (quoted via {src['quoted_via']})" if src.get("quoted_via") else "") + ".", "",
                  "| benchmark | model | b | accuracy (%) | cents per query | how |", "|---|---|---|---|---|---|"]
        for p in refs.points:
            cents = "-" if p.cents_per_query is None else f"{p.cents_per_query:.2f}"
            lines.append(f"| {p.benchmark} | {p.model} | {p.budget} | {_fmt(p.accuracy, True)} | {cents} | {p.how} |")
        lines += [""] + [f"- The write-up: \"{n}\"" for n in refs.notes]
        lines += [f"- Assumed: {a}." for a in refs.assumptions]
        lines += [""] if refs.notes or refs.assumptions else []
    return "\n".join(lines)


def reference_series(refs: Optional[References], bench: str, kind: str) -> list[tuple[str, list, list, list]]:
    """The write-up's markers for one panel: [(label, xs, accuracies %, budgets)] per reference model, x = b
    ("budget") or cents per query ("cost", only points that have a cost)."""
    out = []
    pts = [p for p in (refs.points if refs else ())
           if p.benchmark == bench and (kind == "budget" or p.cents_per_query is not None)]
    for label in dict.fromkeys(p.label for p in pts):
        mine = sorted((p for p in pts if p.label == label), key=lambda p: p.budget)
        xs = [p.budget if kind == "budget" else p.cents_per_query for p in mine]
        out.append((label, xs, [100 * p.accuracy for p in mine], [p.budget for p in mine]))
    return out


def plot(curve: dict, out_dir: Path, references: Optional[References] = None) -> list[Path]:
    """accuracy_vs_budget.png always; accuracy_vs_cost.png when some model has a price. The write-up's points
    for the same benchmarks are drawn as hollow markers labelled "write-up: <model>"."""
    # start-up: matplotlib (0.3-0.5 s) and its process-wide Agg backend switch, only when plots are drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: pyplot, after the backend switch above

    benches = sorted({b for m in curve.values() for b in m})
    if not benches:
        return []
    written = []
    for kind in ("budget", "cost"):
        if kind == "cost" and not any(s.get("cents_per_query") is not None
                                      for m in curve.values() for pts in m.values() for s in pts.values()):
            continue
        fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
        for ax, bench in zip(axes[0], benches):
            for model, m in curve.items():
                pts = sorted(m.get(bench, {}).items())
                if kind == "budget":
                    xs, ys = [b for b, _ in pts], [100 * s["accuracy"] for _, s in pts]
                else:
                    pts = [(b, s) for b, s in pts if s.get("cents_per_query") is not None]
                    xs, ys = [s["cents_per_query"] for _, s in pts], [100 * s["accuracy"] for _, s in pts]
                if xs:
                    ax.plot(xs, ys, marker="o", label=model)
                    if kind == "cost":
                        for (b, _), x, y in zip(pts, xs, ys):
                            ax.annotate(f"b={b}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
            for (label, xs, ys, bs), marker in zip(reference_series(references, bench, kind), "DsP^v*"):
                ax.plot(xs, ys, linestyle="none", marker=marker, markersize=7, markerfacecolor="none", label=label)
                if kind == "cost":
                    for b, x, y in zip(bs, xs, ys):
                        ax.annotate(f"b={b}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, -9))
            if references is not None and bench in references.missing:
                ax.text(0.02, 0.02, f"{WRITE_UP}: no figures quoted for {bench}", transform=ax.transAxes,
                        fontsize=7, color="grey")
            ax.set_title(bench)
            ax.set_xlabel("tool budget b" if kind == "budget" else "cents per query (list price, no caching)")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"accuracy_vs_{kind}.png"
        tmp = out_dir / f".accuracy_vs_{kind}.tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(path)
        written.append(path)
    return written


def _tb_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model)


def tensorboard(curve: dict, out_dir: Path) -> Path:
    root = out_dir / "tb"
    for model, benches in curve.items():
        w = SummaryWriter(str(root / _tb_name(model)))
        for bench, pts in benches.items():
            for b, s in sorted(pts.items()):
                w.add_scalar(f"{bench}/accuracy", s["accuracy"], b)
                w.add_scalar(f"{bench}/mean_tool_calls", s["mean_tool_calls"], b)
                w.add_scalar(f"{bench}/tokens_in", s["mean_tokens_in"], b)
                w.add_scalar(f"{bench}/tokens_out", s["mean_tokens_out"], b)
                if s.get("cents_per_query") is not None:
                    w.add_scalar(f"{bench}/cents_per_query", s["cents_per_query"], b)
        w.close()
    return root


def write_outputs(report: dict, out_dir: str | Path, tb: bool = True) -> dict[str, str]:
    """report.json, report.md, the plots and (optionally) TensorBoard scalars; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", markdown(report) + "\n")
    paths = {"json": str(out_dir / "report.json"), "markdown": str(out_dir / "report.md")}
    for p in plot(report["budget_curve"], out_dir, references_from_dict(report.get("references"))):
        paths[p.stem] = str(p)
    if tb:
        paths["tensorboard"] = str(tensorboard(report["budget_curve"], out_dir))
    return paths


def curve_from_json(curve: dict) -> dict:
    """report.json's curve (budget keys became strings) with int budgets again."""
    return {m: {bench: {int(b): s for b, s in pts.items()} for bench, pts in benches.items()}
            for m, benches in curve.items()}


def price_rows(prices: dict[str, Price]) -> dict:
    return {m: {"name": p.name, "input_usd_per_1m": p.input_usd_per_1m, "output_usd_per_1m": p.output_usd_per_1m,
                "date": p.date, "source": p.source, "note": p.note} for m, p in prices.items()}


def build_report(run: str, curve: dict, deployment: dict, prices: dict[str, Price], extra: Optional[dict] = None,
                 references: Optional[References] = None) -> dict:
    """The report dict; `references` is cut to the benchmarks of the curve and kept only when it says something
    about them (points or a "missing" note)."""
    report = {"run": run, "budget_curve": curve, "deployment": deployment, "prices": price_rows(prices), **(extra or {})}
    if references is not None:
        mine = references.for_benchmarks({b for m in curve.values() for b in m})
        if mine.points or mine.missing:
            report["references"] = mine.to_dict()
    return report
