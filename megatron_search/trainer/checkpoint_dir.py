"""Checkpoint directories: atomic publication, a `latest` pointer, keep-last-N.

Layout under the checkpoint root:
    step_00000012/        a complete checkpoint (only ever appears complete: it is written as
                          step_00000012.tmp-<nonce>/ and renamed when every rank has finished)
    latest                the name of the newest complete checkpoint, replaced atomically
A crash while saving leaves a *.tmp-* directory that loaders ignore and the next save removes, so
the previous checkpoint always stays loadable. What goes inside a checkpoint is the caller's
business (trainer/checkpoint.py writes Megatron's sharded state and the run state).
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Optional

STEP_RE = re.compile(r"^step_(\d{8})$")
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The checkpoint named by `latest`, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        p = root / pointer.read_text().strip()
        if STEP_RE.match(p.name) and p.is_dir():
            return p
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


def staging_dir(root: str | Path, step: int, nonce: str) -> Path:
    """Where every rank writes its part of checkpoint `step` (the nonce must be the same on all ranks)."""
    return Path(root) / f"{step_dir_name(step)}.tmp-{nonce}"


def publish(root: str | Path, step: int, nonce: str, keep_last: int) -> Path:
    """Rank 0, after all ranks wrote into the staging dir: rename it into place, move `latest`,
    and drop old checkpoints and leftovers of crashed saves."""
    root = Path(root)
    staged, final = staging_dir(root, step, nonce), root / step_dir_name(step)
    if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_atomic(root / LATEST, final.name)
    for _, old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if ".tmp-" in p.name and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    return final


def save_checkpoint(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    keep_last: int,
    nonce: Optional[str] = None,
    barrier: Callable[[], None] = lambda: None,
    is_rank0: bool = True,
) -> Path:
    """Write checkpoint `step` with `write(staging_dir)` on every rank, then publish it atomically.

    `nonce` must agree across ranks (broadcast it); single-process callers may leave it None.
    """
    nonce = nonce or uuid.uuid4().hex[:12]
    root = Path(root)
    staged = staging_dir(root, step, nonce)
    if is_rank0:
        staged.mkdir(parents=True, exist_ok=True)
    barrier()
    write(staged)
    barrier()
    final = root / step_dir_name(step)
    if is_rank0:
        publish(root, step, nonce, keep_last)
    barrier()
    return final
