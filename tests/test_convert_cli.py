"""Conversion entry points: argument handling and the checks that run before any process starts.

The conversion itself (TP=2 save, PP=2 load, bitwise export) runs in tests/test_weights_roundtrip.py.
"""
from __future__ import annotations

import pytest

from megatron_search.cli import build_parser
from megatron_search.weights.convert import build_parser as tool_parser
from megatron_search.weights.convert import convert, world_size_for


def test_world_size_fits_expert_parallel_inside_a_stage():
    assert world_size_for(2, 1, 1, 2) == 2  # EP=1: experts follow TP
    assert world_size_for(1, 1, 2, 1) == 2  # EP=2 needs DP=2
    assert world_size_for(2, 2, 4, 1) == 8  # lcm(TP=2, EP*ETP=4) per stage, 2 stages
    assert world_size_for(1, 2, 1, 1) == 2


def test_cli_and_tool_parse_the_same_options():
    args = build_parser().parse_args(["convert", "mcore-to-hf", "--src", "a", "--out", "b", "--pp", "2",
                                      "--dtype", "bfloat16", "--set", "model.seed=3"])
    assert (args.direction, args.src, args.pp, args.dtype, args.overrides) == ("mcore-to-hf", "a", 2, "bfloat16",
                                                                              ["model.seed=3"])
    t = tool_parser("hf_to_mcore").parse_args(["--hf", "x", "--out", "y", "--ep", "2", "model.seed=3"])
    assert (t.src, t.out, t.ep, t.etp, t.overrides) == ("x", "y", 2, None, ["model.seed=3"])


def test_missing_config_fails_before_spawning(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert("hf_to_mcore", tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="hf_extra"):
        convert("mcore_to_hf", tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="direction"):
        convert("sideways", tmp_path, tmp_path / "out")
