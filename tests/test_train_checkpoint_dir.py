"""Checkpoint directories: atomic publication, crash safety, keep-last-N."""
import os
import signal

import pytest

from megatron_search.trainer.checkpoint_dir import latest_checkpoint, list_checkpoints, save_checkpoint
from megatron_search.trainer.signals import StopRequest


def writer(payload):
    def write(d):
        (d / "state.txt").write_text(payload)
    return write


def test_save_publish_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, writer(f"s{step}"), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000004" and (latest / "state.txt").read_text() == "s4"
    assert (tmp_path / "latest").read_text() == "step_00000004"


def test_crash_while_writing_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 5, writer("good"), keep_last=3)

    def crashing(d):
        (d / "state.txt").write_text("half")
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 6, crashing, keep_last=3)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000005" and (latest / "state.txt").read_text() == "good"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]
    # The next successful save removes the leftover staging directory.
    save_checkpoint(tmp_path, 6, writer("ok"), keep_last=3)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_latest_falls_back_to_newest_complete(tmp_path):
    save_checkpoint(tmp_path, 1, writer("a"), keep_last=3)
    (tmp_path / "latest").write_text("step_00000099")  # points at something missing
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_stop_request_flag():
    stop = StopRequest()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signum == signal.SIGUSR1
    finally:
        stop.restore()
