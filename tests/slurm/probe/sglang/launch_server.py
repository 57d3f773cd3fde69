"""Records what an SGLang server process started by slurm/lib.sh sees, then exits.

tests/slurm/engine_probe.sh puts this folder first on PYTHONPATH, so the engines' SGLang main (run by
rollout/sglang/serve.py from the launch plan's argv) is this instead of a server: it writes its argv
(the API key replaced by its sha256), node, GPU environment, whether the key is on the process's real
command line (/proc/self/cmdline) and whether the key's variable is still in its environment, as JSON
into $MS_PROBE_DIR, one file per process.
"""
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

KEYS = ("SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")

if __name__ == "__main__":
    out = Path(os.environ["MS_PROBE_DIR"])
    argv = sys.argv[1:]
    key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else None
    cmdline = Path("/proc/self/cmdline").read_bytes()
    record = {"argv": [hashlib.sha256(a.encode()).hexdigest() if a == key else a for a in argv],
              "host": socket.gethostname(), "pid": os.getpid(),
              "env": {k: os.environ.get(k) for k in KEYS},
              "api_key_sha256": hashlib.sha256(key.encode()).hexdigest() if key else None,
              "api_key_in_cmdline": bool(key) and key.encode() in cmdline,
              "api_key_in_environ": bool(key) and any(v == key for v in os.environ.values())}
    name = f"engine_{record['env']['SLURMD_NODENAME']}_{record['env']['SLURM_STEP_ID']}.json"
    (out / name).write_text(json.dumps(record))
