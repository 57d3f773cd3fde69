"""`pip install .` (a built wheel, not editable) works outside the checkout: the package carries kernels/ and
configs/ (setup.py's build step), and the CLI finds the shipped configs from any directory.

The venv is new but reads this one's packages after its own, so only megatron-search itself is installed
(--no-deps, built without build isolation: nothing is downloaded); its own copy comes first on the path."""
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess


def test_wheel_install_runs_from_another_directory(tmp_path):
    # the wheel, built by this environment's setuptools (no build isolation: nothing is downloaded)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("megatron_search-*.whl")
    # a new venv that reads this environment's packages after its own (a .pth line: no editable finder of ours runs)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py, cli = venv / "bin" / "python", venv / "bin" / "megatron-search"
    child_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                                capture_output=True, text=True).stdout.strip()
    (Path(child_site) / "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    out = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"

    def run(*argv, timeout=300):
        r = subprocess.run([str(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout, cwd=elsewhere,
                           env=env)
        assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-3000:])
        return r.stdout

    where = run(py, "-c", "import megatron_search, megatron_search.kernels as k; "
                          "from megatron_search.config.model import data_root; "
                          "print(megatron_search.__file__); print(k.__file__); print(data_root())").split()
    venv_lib = str(venv / "lib")
    assert all(w.startswith(venv_lib) for w in where), where  # the installed copy, not the checkout
    assert (Path(where[2]) / "configs" / "models" / "demo_qwen3_moe" / "config.json").is_file()
    shipped = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*") if p.is_file())
    installed = sorted(p.relative_to(where[2]).as_posix() for p in Path(where[2]).rglob("*") if p.is_file())
    assert installed == shipped
    # the demo's config (and the model config it names) and a training smoke test from the packaged files
    assert "demo_qwen3_moe" in run(cli, "config", "configs/demo.yaml")
    run(cli, "smoke", "configs/tiny_cpu.yaml")
