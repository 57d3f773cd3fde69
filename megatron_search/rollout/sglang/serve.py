"""Start an SGLang server whose API key comes from the environment, never from argv or the logs.

    python -m megatron_search.rollout.sglang.serve --api-key-env NAME [--module M] <M's args ...>

M is `sglang.launch_server` (default) or `sglang_router.launch_router`, whose `--api-key` protects
the router and is inherited by the workers given in --worker-urls (sglang-router's README).

SGLang 0.5.23 takes its key only as `--api-key` (srt/arg_groups/fields/serving.py; no environment
variable), and it logs the key: `server_args={...}` at startup (srt/entrypoints/engine.py) and
`launch_command` carry it verbatim. Anything in argv is world-readable in /proc/<pid>/cmdline. So:

1. the key is read from `$NAME` and removed from this process's environment (SGLang's workers do
   not inherit it; they get the parsed arguments from their parent over multiprocessing's pipe);
2. stdout and stderr (file descriptors 1 and 2, inherited by every worker process) become a pipe
   that a thread copies to the real output with the key replaced by `<redacted>`;
3. SGLang's own `python -m sglang.launch_server` main runs in this process (runpy) with
   `--api-key <key>` appended to its in-memory sys.argv. /proc/<pid>/cmdline keeps the argv the
   process was started with, which never held the key.

The key stays readable by the same user in /proc/<pid>/environ of this process, as any secret
passed through the environment is; /server_info, which echoes server arguments, needs the key.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
from typing import Optional

from megatron_search.rollout.engine.auth import EngineKeyError, check_key

REDACTED = b"<redacted>"


class RedactingPipe:
    """fds 1 and 2 (and so every child's) write into a pipe; a thread forwards it with `secret` masked."""

    def __init__(self, secret: str):
        self.secret = secret.encode()
        self.out = os.dup(1)  # the real stdout / stderr: the server's log file
        self.err = os.dup(2)
        self.read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = threading.Thread(target=self._pump, name="redact-output", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        keep = len(self.secret) - 1  # a tail this short cannot hold the whole secret: hold it back
        pending = b""
        while True:
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                break
            pending = (pending + chunk).replace(self.secret, REDACTED)
            cut = pending.rfind(b"\n") + 1  # whole lines go out now (the secret has no newline) ...
            cut = max(cut, len(pending) - keep)  # ... and of a partial line all but the last `keep` bytes
            if cut > 0:
                os.write(self.out, pending[:cut])
                pending = pending[cut:]
        if pending:
            os.write(self.out, pending.replace(self.secret, REDACTED))
        os.close(self.read_fd)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop writing into the pipe from this process and let the thread drain what is left."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.out, 1)
        os.dup2(self.err, 2)
        self.thread.join(timeout_s)  # workers still alive hold the pipe open: do not wait for them forever


MODULES = ("sglang.launch_server", "sglang_router.launch_router")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--api-key-env":
        print("usage: python -m megatron_search.rollout.sglang.serve --api-key-env NAME [--module M] <M's args>",
              file=sys.stderr)
        return 2
    name, rest = argv[1], argv[2:]
    module = MODULES[0]
    if rest[:1] == ["--module"]:
        if len(rest) < 2 or rest[1] not in MODULES:
            print(f"error: --module must be one of {', '.join(MODULES)}", file=sys.stderr)
            return 2
        module, rest = rest[1], rest[2:]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in rest):
        print("error: pass the key in the environment ($%s), not as --api-key" % name, file=sys.stderr)
        return 2
    value = os.environ.pop(name, "")
    if not value:
        print(f"error: ${name} is not set: it must hold the engine API key (rollout.api_key_env)", file=sys.stderr)
        return 2
    try:
        key = check_key(value, f"${name}")
    except EngineKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pipe = RedactingPipe(key)
    atexit.register(pipe.close)
    sys.argv = [sys.argv[0], *rest, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
