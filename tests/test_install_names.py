"""No name in the checkout's root shadows an installed package.

`python -m pytest`, `python -m megatron_search.cli` and `python -c ...` started in the checkout put its
root first on sys.path. A folder there with an __init__.py (or a .py file) is then imported in place of
an installed package of the same name: our old kernels/__init__.py hid Hugging Face's `kernels`, which
transformers >= 5.25 imports when it loads a model. A folder without __init__.py is only a namespace
candidate, which any installed regular package of that name beats."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # each check starts a Python in the checkout's root

REPO = Path(__file__).resolve().parents[1]
OURS = {"megatron_search", "setup"}  # our one top-level package, and the build script (setup.py)
PROBE = """import importlib.util, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        out[name] = {"error": repr(e)}
        continue
    out[name] = None if spec is None else {"origin": spec.origin,
                                           "locations": list(spec.submodule_search_locations or [])}
print(json.dumps(out))
"""


def top_level_names() -> list[str]:
    """Every name `import NAME` could find in the checkout's root (folders and .py files)."""
    names = {p.name for p in REPO.iterdir() if p.is_dir() and p.name.isidentifier()}
    names |= {p.stem for p in REPO.glob("*.py") if p.stem.isidentifier()}
    return sorted(names)


def specs_from(cwd: Path, names: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    proc = subprocess.run([sys.executable, "-c", PROBE, *names], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_tree_has_the_names_we_check():
    names = top_level_names()
    for name in ("kernels", "tools", "scripts", "configs", "tests", "slurm", "megatron_search"):
        assert name in names, f"{name}/ is not in the checkout's root any more: update this test"


def test_no_root_name_shadows_an_installed_package(tmp_path):
    names = top_level_names()
    at_root, elsewhere = specs_from(REPO, names), specs_from(tmp_path, names)
    for name in names:
        installed, here = elsewhere[name], at_root[name]
        if name == "megatron_search":
            continue  # installed (editable) from this very checkout
        if installed is not None and installed.get("origin") not in (None, "namespace"):
            # an installed regular package or module: the checkout's root must not change what it is
            assert here == installed, f"`import {name}` in the checkout's root gives {here}, elsewhere {installed}"
        elif name not in OURS:
            # nothing installed: at most a namespace over our folder, which runs none of our code
            assert here is None or here.get("origin") in (None, "namespace"), (
                f"`import {name}` in the checkout's root loads {here['origin']}: a top-level {name} of ours "
                "would shadow any installed package of that name (remove its __init__.py or rename it)")


def test_kernels_from_the_root_is_hugging_faces(tmp_path):
    # Hugging Face's kernels when installed (transformers >= 5.25 needs it); else at most a namespace over our
    # folder, which runs none of our code (__file__ None)
    code = "import kernels; print(getattr(kernels, '__file__', None))"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    loaded = {}
    for where in (REPO, tmp_path):
        proc = subprocess.run([sys.executable, "-c", code], cwd=where, env=env, capture_output=True, text=True,
                              timeout=120)
        loaded[where] = proc.stdout.strip() if proc.returncode == 0 else "missing"
    if loaded[tmp_path] == "missing":
        assert loaded[REPO] == "None", f"`import kernels` in the checkout's root loaded {loaded[REPO]}"
        return
    at_root = Path(loaded[REPO]).resolve()
    assert (REPO / "kernels") not in at_root.parents, f"`import kernels` in the checkout's root loaded {at_root}"
    assert at_root == Path(loaded[tmp_path]).resolve()  # the installed package, wherever Python starts


def test_transformers_loads_a_model_from_the_root(tmp_path):
    # hub_kernels (transformers >= 5.25) imports `kernels` when a model is loaded: load one from the root
    code = ("import importlib.util, torch, transformers\n"
            "if importlib.util.find_spec('transformers.integrations.hub_kernels'):\n"
            "    from transformers.integrations import hub_kernels\n"
            f"c = transformers.AutoConfig.from_pretrained({str(REPO / 'configs/models/tiny_qwen3_moe')!r})\n"
            "transformers.AutoModelForCausalLM.from_config(c)\nprint('ok')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_our_kernels_are_megatron_search_kernels():
    import megatron_search.kernels as k
    from megatron_search.kernels import logprob

    assert callable(k.token_logprobs) and k.token_logprobs is logprob.token_logprobs
    assert Path(logprob.__file__).resolve().parent in (REPO / "kernels", Path(k.__file__).resolve().parent)
    assert not (REPO / "kernels" / "__init__.py").exists()
