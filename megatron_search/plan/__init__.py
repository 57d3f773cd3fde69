"""Parallelism and memory planner: checks a layout on a cluster before a job is submitted."""
from .memory import Plan, make_plan
from .params import ParamCounts, active_params, count_params
from .report import format_plan

__all__ = ["Plan", "ParamCounts", "active_params", "count_params", "format_plan", "make_plan"]
