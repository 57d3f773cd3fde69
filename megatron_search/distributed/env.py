"""Where this process sits in the job: rank, world size, local rank, master address and port.

Read from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or, when
those are absent, from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; master = first host of
SLURM_JOB_NODELIST, port from MASTER_PORT or derived from SLURM_JOB_ID). A lone process with
neither set runs as world size 1 on 127.0.0.1.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_MASTER_PORT = 29500
# Slurm job ids map to ports in [_PORT_BASE, _PORT_BASE + _PORT_SPAN) so concurrent jobs on one node differ.
_PORT_BASE, _PORT_SPAN = 20000, 20000


class DistEnvError(RuntimeError):
    """The launcher's environment does not describe a valid process placement."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"


def expand_hostlist(spec: str) -> list[str]:
    """Expand Slurm's compressed host list: 'node[01-03,7],gpu5' -> node01 node02 node03 node7 gpu5.

    Zero padding of ranges is kept ('[08-10]' -> 08 09 10); several bracket groups in one name
    expand as a product ('r[1-2]n[1-2]'). Raises DistEnvError on malformed input.
    """
    hosts: list[str] = []
    for item in _split_top_level(spec.strip(), spec):
        hosts.extend(_expand_one(item, spec))
    return hosts


def _split_top_level(spec: str, whole: str) -> list[str]:
    items, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistEnvError(f"SLURM_JOB_NODELIST {whole!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise DistEnvError(f"SLURM_JOB_NODELIST {whole!r}: unbalanced '['")
    items.append("".join(cur))
    if any(not it for it in items):
        raise DistEnvError(f"SLURM_JOB_NODELIST {whole!r}: empty host name")
    return items


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    prefix, rest = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        if re.fullmatch(r"\d+", part):
            values = [part]
        elif re.fullmatch(r"\d+-\d+", part):
            lo, hi = part.split("-")
            if int(hi) < int(lo):
                raise DistEnvError(f"SLURM_JOB_NODELIST {whole!r}: descending range {part!r}")
            values = [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        else:
            raise DistEnvError(f"SLURM_JOB_NODELIST {whole!r}: bad range {part!r}")
        for v in values:
            out.extend(_expand_one(prefix + v + rest, whole))
    return out


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistEnvError(f"{key}={env[key]!r} is not an integer") from None


def read_dist_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Placement of this process from torchrun or Slurm variables (torchrun wins when both exist)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        if world > 1 and "MASTER_ADDR" not in env:
            raise DistEnvError("torchrun variables set (RANK, WORLD_SIZE) but MASTER_ADDR is missing")
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
        return _checked(DistEnv(rank, world, local, addr, port, "torchrun"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world, rank = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            addr = expand_hostlist(nodelist)[0]
        elif world == 1:
            addr = "127.0.0.1"
        else:
            raise DistEnvError("Slurm variables set but SLURM_JOB_NODELIST is missing: cannot pick the master host")
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        elif "SLURM_JOB_ID" in env:
            port = _PORT_BASE + _int(env, "SLURM_JOB_ID") % _PORT_SPAN
        else:
            port = DEFAULT_MASTER_PORT
        return _checked(DistEnv(rank, world, local, env.get("MASTER_ADDR", addr), port, "slurm"))
    if _int_or(env, "WORLD_SIZE", 1) > 1:
        raise DistEnvError(
            "WORLD_SIZE > 1 but neither torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) "
            "nor Slurm variables (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST) are set"
        )
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 0
    return DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")


def _int_or(env: Mapping[str, str], key: str, default: int) -> int:
    return _int(env, key) if key in env else default


def _checked(e: DistEnv) -> DistEnv:
    if e.world_size < 1:
        raise DistEnvError(f"{e.source}: world size {e.world_size} < 1")
    if not 0 <= e.rank < e.world_size:
        raise DistEnvError(f"{e.source}: rank {e.rank} outside [0, {e.world_size})")
    if e.local_rank < 0:
        raise DistEnvError(f"{e.source}: local rank {e.local_rank} < 0")
    if not 0 <= e.master_port < 65536:
        raise DistEnvError(f"{e.source}: master port {e.master_port} out of range")
    return e
