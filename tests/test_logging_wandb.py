"""logging.wandb: the run's scalars and config go to a Weights & Biases run, offline (nothing leaves the machine),
read back here from the run's own .wandb file (a LevelDB-style log of wandb's protobuf records, parsed below
without wandb's writer code)."""
import json
from pathlib import Path

import pytest

from megatron_search.config import load_config
from megatron_search.trainer.metrics import MetricsWriter

pytestmark = pytest.mark.multiprocess  # wandb starts its own service process


def wandb_records(path: Path):
    """The records of a .wandb file: 7-byte header ':W&B' + magic + version, then 32 KiB blocks of chunks (crc32 4,
    length 2 little-endian, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield pb.Record.FromString(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield pb.Record.FromString(buf + chunk)


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["logging.wandb=true", "run.name=wb-test", f"run.output_dir={tmp_path}"])
    assert cfg.logging.wandb_mode == "offline"
    w = MetricsWriter.for_run(cfg, tmp_path, main=True)
    for step in range(3):
        w.scalars(step, {"train/loss": 1.0 / (step + 1), "reward/mean": 0.25 * step, "skipped": float("nan")})
    w.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, name = {}, {}, None
    for r in wandb_records(run):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history[int(items.get("_step", r.history.step.num))] = items
        elif kind == "config":
            for u in r.config.update:
                config[u.key] = json.loads(u.value_json)
        elif kind == "run":  # the run's record carries the config given at init
            name = name or r.run.display_name or None
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
    assert name == "wb-test"
    assert sorted(history) == [0, 1, 2]
    for step, items in history.items():
        assert items["train/loss"] == pytest.approx(1.0 / (step + 1)) and items["reward/mean"] == 0.25 * step
        assert "skipped" not in items  # non-finite values are left out, as in TensorBoard
    assert config["run"]["name"] == "wb-test" and config["logging"]["wandb"] is True
    assert (tmp_path / "tensorboard").is_dir()  # TensorBoard as well


def test_wandb_off_by_default(tmp_path):
    w = MetricsWriter.for_run(load_config(None, [f"run.output_dir={tmp_path}"]), tmp_path, main=True)
    w.close()
    assert not (tmp_path / "wandb").exists()
