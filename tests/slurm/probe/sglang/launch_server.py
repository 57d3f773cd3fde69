"""Records what an SGLang server process started by slurm/lib.sh sees, then exits.

tests/slurm/engine_probe.sh puts this folder first on PYTHONPATH, so the engines' own argv
(`python -m sglang.launch_server ...`, from the launch plan) runs this instead of a server: it writes
its argv, node and GPU environment as JSON into $MS_PROBE_DIR, one file per process.
"""
import json
import os
import socket
import sys
from pathlib import Path

KEYS = ("SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")

if __name__ == "__main__":
    out = Path(os.environ["MS_PROBE_DIR"])
    record = {"argv": sys.argv[1:], "host": socket.gethostname(), "pid": os.getpid(),
              "env": {k: os.environ.get(k) for k in KEYS}}
    name = f"engine_{record['env']['SLURMD_NODENAME']}_{record['env']['SLURM_STEP_ID']}.json"
    (out / name).write_text(json.dumps(record))
