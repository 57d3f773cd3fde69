"""Conversion entry points: argument handling and the checks that run before any process starts.

The conversion itself (TP=2 save, PP=2 load, bitwise export) runs in tests/test_weights_roundtrip.py.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_search.cli import build_parser
from megatron_search.weights.convert import convert, world_size_for

REPO = Path(__file__).resolve().parents[1]


def test_world_size_fits_expert_parallel_inside_a_stage():
    assert world_size_for(2, 1, 1, 2) == 2  # EP=1: experts follow TP
    assert world_size_for(1, 1, 2, 1) == 2  # EP=2 needs DP=2
    assert world_size_for(2, 2, 4, 1) == 8  # lcm(TP=2, EP*ETP=4) per stage, 2 stages
    assert world_size_for(1, 2, 1, 1) == 2


def test_the_cli_parses_the_conversion_options():
    args = build_parser().parse_args(["convert", "mcore-to-hf", "--src", "a", "--out", "b", "--pp", "2",
                                      "--dtype", "bfloat16", "--set", "model.seed=3"])
    assert (args.direction, args.src, args.pp, args.dtype, args.overrides) == ("mcore-to-hf", "a", 2, "bfloat16",
                                                                              ["model.seed=3"])


@pytest.mark.parametrize("entry", [["-m", "megatron_search.cli", "convert", "hf-to-mcore"],
                                   [str(REPO / "tools" / "convert_hf_to_mcore.py")]])
def test_a_missing_source_is_one_line_and_fast_from_both_entry_points(entry, tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *entry, "--src", "/nonexistent", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["megatron-search convert hf-to-mcore: --src /nonexistent: no such directory"]
    assert elapsed < 2.0, elapsed


def test_wrong_sources_are_named_before_spawning(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors here"):
        convert("hf_to_mcore", tmp_path / "empty", tmp_path / "out")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert("hf_to_mcore", tmp_path / "hf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="neither a Megatron distributed checkpoint"):
        convert("mcore_to_hf", tmp_path / "empty", tmp_path / "out")
    (tmp_path / "mc").mkdir()
    (tmp_path / "mc" / "metadata.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="hf_extra/config.json"):
        convert("mcore_to_hf", tmp_path / "mc", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        convert("mcore_to_hf", tmp_path / "mc" / "metadata.json", tmp_path / "out")
    with pytest.raises(ValueError, match="direction"):
        convert("sideways", tmp_path, tmp_path / "out")
