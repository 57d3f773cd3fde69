"""Evaluation (RECIPE 8): benchmarks, graders, the budget sweep, deployment metrics, cost, reports.

Entry points: `evaluate(cfg, models, benchmarks, out_dir, ...)` (run.py) and `megatron-search eval`.
"""
from __future__ import annotations

from .benchmarks import KINDS, EvalExample, load_benchmark, subsample
from .run import BenchmarkSpec, evaluate, evaluate_async, make_report

__all__ = ["KINDS", "BenchmarkSpec", "EvalExample", "evaluate", "evaluate_async", "load_benchmark", "make_report", "subsample"]
