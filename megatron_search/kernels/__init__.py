"""Fused kernels (Triton on GPU, torch references on CPU): the top-level kernels/ folder, as a package.

The sources live in the checkout's kernels/ folder, which has no __init__.py on purpose: a regular
package there would be `import kernels` for any process whose path holds the checkout's root
(`python -m pytest`, `python -m megatron_search.cli`), and would shadow Hugging Face's `kernels`,
which transformers imports. This file makes them `megatron_search.kernels`: in a checkout it adds
that folder to the package's path; a built wheel has the modules beside this file (setup.py)."""
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_SOURCES = _HERE.parents[1] / "kernels"
if not (_HERE / "backend.py").is_file():  # a checkout (editable or on sys.path), not a built wheel
    if not (_SOURCES / "backend.py").is_file():
        raise ImportError(f"megatron_search.kernels: no kernel sources beside {_HERE} nor in {_SOURCES}")
    __path__.append(str(_SOURCES))  # noqa: F821 (set by the import system for a package)

from .backend import resolve_backend  # noqa: E402
from .group_advantage import GroupAdvantages, fused_group_advantages, offsets_from_group_ids  # noqa: E402
from .is_ratio import mismatch_stats  # noqa: E402
from .linear_logprob import linear_token_logprobs  # noqa: E402
from .logprob import TokenLogprobs, token_logprobs  # noqa: E402

__all__ = [
    "GroupAdvantages",
    "TokenLogprobs",
    "fused_group_advantages",
    "linear_token_logprobs",
    "mismatch_stats",
    "offsets_from_group_ids",
    "resolve_backend",
    "token_logprobs",
]
