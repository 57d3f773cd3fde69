"""The package layering of docs/ARCHITECTURE.md, enforced on every import, function-local ones included.

The layer table is read from docs/ARCHITECTURE.md (written once, there): a package may import only
packages on a lower layer; packages on the same layer do not import each other. A cycle between
packages is then impossible. Imports are found with `ast`, so an import inside a function counts."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = {"megatron_search": REPO / "megatron_search", "megatron_search.kernels": REPO / "kernels"}


def layer_table() -> dict[str, int]:
    """{package: layer} from the table under '## Layers' in docs/ARCHITECTURE.md (layer 0 at the bottom)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for row in re.finditer(r"^\| *(\d+) *\| *([^|]+)\|", section, re.M):
        for pkg in re.findall(r"`([a-z_]+)`", row[2]):
            assert pkg not in layers, f"docs/ARCHITECTURE.md: {pkg} is on two layers"
            layers[pkg] = int(row[1])
    assert layers, "docs/ARCHITECTURE.md: no layer table under '## Layers'"
    return layers


def _module_name(root: str, base: Path, path: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root, *parts])


def _package(module: str) -> str | None:
    """The first-level package of a megatron_search module ('text' for megatron_search.text)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron_search" and len(parts) > 1 else None


def internal_imports() -> list[tuple[str, str, str, int]]:
    """(importing package, imported package, file, line) for every import between two packages."""
    out = []
    for root, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            module = _module_name(root, base, path)
            me = _package(module)
            if me is None:  # megatron_search/__init__.py
                continue
            is_pkg = path.name == "__init__.py"
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        up = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                        targets = [".".join(up + ([node.module] if node.module else []))]
                    else:
                        targets = [node.module or ""]
                else:
                    continue
                for target in targets:
                    other = _package(target)
                    if other is not None and other != me:
                        out.append((me, other, str(path.relative_to(REPO)), node.lineno))
    return out


def test_every_package_is_on_a_layer():
    layers = layer_table()
    found = {p.name for p in (REPO / "megatron_search").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in (REPO / "megatron_search").glob("*.py") if p.stem != "__init__"} | {"kernels"}
    assert found == set(layers), f"docs/ARCHITECTURE.md layers miss {sorted(found - set(layers))}, " \
                                 f"name unknown {sorted(set(layers) - found)}"


def test_no_package_imports_its_own_layer_or_above():
    layers = layer_table()
    bad = [f"{f}:{line}: {me} (layer {layers[me]}) imports {other} (layer {layers[other]})"
           for me, other, f, line in internal_imports() if layers[other] >= layers[me]]
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_the_import_scan_sees_function_local_and_relative_imports():
    """The scanner itself, on this repo's known edges: a function-local import (cli/ imports its commands
    lazily) and a relative one (rl/advantages.py: `from ..rewards.gated import ...`)."""
    edges = {(me, other, f) for me, other, f, _ in internal_imports()}
    assert ("rl", "rewards", "megatron_search/rl/advantages.py") in edges
    smoke = (REPO / "megatron_search/cli/smoke.py").read_text()
    assert re.search(r"^\s+from megatron_search\.trainer", smoke, re.M)  # indented: inside a function
    assert ("cli", "trainer", "megatron_search/cli/smoke.py") in edges


def parallel_state_uses() -> list[str]:
    """Every import of Megatron's global parallel state (parallel_state, or its old name mpu), as file:line."""
    out = []
    for root, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(re.match(r"megatron\.core\.(parallel_state|mpu)\b", n) for n in names):
                    out.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return out


def test_parallel_state_is_read_only_in_distributed():
    """Outside distributed/, process groups are passed in (DistContext.groups), never read from Megatron's
    globals: what a function reduces over is then visible in its signature."""
    bad = [u for u in parallel_state_uses() if not u.startswith("megatron_search/distributed/")]
    assert not bad, "parallel_state outside megatron_search/distributed/ (take `groups` instead):\n" + "\n".join(bad)
    assert any(u.startswith("megatron_search/distributed/init.py") for u in parallel_state_uses())  # the scan works


# Function-local imports are allowed only with a reason: an optional dependency, or start-up time / an import
# cycle that a top-level import would cost.
REASONS = ("# optional:", "# start-up:")
# Pending: megatron_search/weights/ is being reworked in parallel; its local imports get their reasons there.
PENDING: tuple[str, ...] = ()


def function_local_imports_without_reason() -> list[str]:
    """file:line of every import inside a function (outside cli/, which imports its commands lazily) that carries
    no reason: a `# optional:` / `# start-up:` comment at the end of its first line, or as the line directly above
    the run of import lines (blank lines between them allowed) that it belongs to."""
    out = []
    for base in (REPO / "megatron_search", REPO / "kernels"):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(("megatron_search/cli/", *PENDING)):
                continue
            text = path.read_text()
            comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                        if tok.type == tokenize.COMMENT}
            tree = ast.parse(text, str(path))
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            import_lines = {line for n in imports for line in range(n.lineno, n.end_lineno + 1)}
            local = {n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
            lines = text.splitlines()
            for node in sorted(local, key=lambda n: n.lineno):
                if comments.get(node.lineno, "").startswith(REASONS):
                    continue
                top = node.lineno  # first line of the run of import lines this one belongs to
                while True:
                    above = top - 1
                    while above >= 1 and not lines[above - 1].strip():
                        above -= 1
                    if above not in import_lines:
                        break
                    top = above
                above = lines[top - 2].strip() if top >= 2 else ""
                if not above.startswith(REASONS):
                    out.append(f"{rel}:{node.lineno}")
    return out


def test_function_local_imports_carry_a_reason():
    """An import inside a function moves to the top of its module, or says why it cannot: `# optional: <dependency>
    (<what needs it>)` or `# start-up: <what is deferred, for which light path / which import cycle>`."""
    bad = function_local_imports_without_reason()
    assert not bad, ("function-local imports without a '# optional:' or '# start-up:' reason (move them to the top "
                     "of the module, or give the reason):\n" + "\n".join(bad))
