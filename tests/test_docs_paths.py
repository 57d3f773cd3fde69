"""Every repository path and `megatron_search` module that README.md and docs/*.md name exists.

A doc names a path of ours when it starts at a top-level folder of the checkout (`tools/bench_logprob.py`,
`configs/models/tiny_qwen3_moe`, `tests/test_plan.py::test_name`), at a first-level package of
`megatron_search/` (`train/grpo_run.py`, `rollout/local/server.py`: the docs' short form), at a folder
beside the doc (`img/eval_budget_demo.png` inside docs/), or at `../` from the doc (and must stay inside the
repository); a bare source file name (`send_plan.py`) or doc name in capitals (`SLURM.md`) must be some file
of the checkout, and a Markdown link's target must exist relative to the doc's own folder. `x/module.attr` forms (`rl/advantages.filtered_groups`)
and dotted names (`megatron_search.rm.build.preference_service`) must name a module that exists and an
attribute it defines: read with `ast`, so nothing heavy is imported. A glob (`configs/qwen3*_grpo.yaml`)
must match a file, and `{a,b}` alternatives must all exist.

Left alone: URLs, absolute paths (`/generate`, `/path/to/hf`), placeholders (`<output_dir>/...`, `$VAR`),
run outputs and user paths (`runs/...`, `ckpt/...`, `a/train.jsonl`: no folder of ours first), data files
(`.jsonl`, `.csv`, `.parquet`, ...: user inputs in examples), and TensorBoard tags (`train/loss`: no
extension), as well as other projects' sources, which the docs write from their own root
(`vllm/engine/arg_utils.py`, `srt/utils/auth.py`)."""
from __future__ import annotations

import ast
import functools
import glob
import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Top-level entries of the checkout (anything else at the root is a run output or a local cache).
ROOTS = {"megatron_search", "kernels", "configs", "docs", "tests", "tools", "slurm", "scripts", "requirements",
         ".ci", "setup.py", "Makefile", "pytest.ini", "README.md"}
# Extensions whose paths are checked; data files (.jsonl, .csv, .parquet, ...) are user inputs in examples.
CHECKED_EXT = {"py", "sh", "yaml", "yml", "json", "md", "txt", "ini", "in", "png", "jinja", "cfg", "toml"}
SKIP_DIRS = {"__pycache__", ".git", ".cache", ".whl", ".venv", "runs", "build", "dist"}

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
# A path-like token: word characters, dots, dashes, slashes, globs, placeholders, and {a,b} groups.
TOKEN = re.compile(r"(?:[\w.\-/*~$<>]|\{[^{}\s]*\})+")
NODE_ID = re.compile(r"([\w./-]+\.py)::([\w:]+)")
MODULE = re.compile(r"(?<![\w.])megatron_search(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^()\s]+)\)")  # a Markdown link's target, relative to the doc's own folder


@functools.cache
def _file_names() -> set[str]:
    """Base names of the checkout's own files, run outputs and caches left out."""
    names = set()
    for root in ROOTS:
        top = REPO / root
        for p in [top] if top.is_file() else top.rglob("*") if top.is_dir() else []:
            rel = p.relative_to(REPO)
            if p.is_file() and not SKIP_DIRS & set(rel.parts) and not any(x.endswith(".egg-info") for x in rel.parts):
                names.add(p.name)
    return names


@functools.cache
def _packages() -> set[str]:
    """First-level packages of megatron_search/ (`train`, `rollout`, ...): the docs' short paths start there."""
    return {p.name for p in (REPO / "megatron_search").iterdir() if p.is_dir() and p.name not in SKIP_DIRS}


@functools.cache
def _defined_names(path: Path) -> dict[str, ast.AST]:
    """Top-level names a module defines (functions, classes, assignments, imports), by name."""
    tree = ast.parse(path.read_text(), str(path))
    return _names_in(tree.body)


def _names_in(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # guarded definitions (optional imports)
            for block in ("body", "orelse", "finalbody"):
                out.update(_names_in(getattr(node, block, [])))
            for handler in getattr(node, "handlers", []):
                out.update(_names_in(handler.body))
    return out


def _attribute_problem(module_file: Path, attrs: list[str]) -> str | None:
    """Why `attrs` (a name, then members of a class) is not defined in module_file; None when it is."""
    names = _defined_names(module_file)
    rel = module_file.relative_to(REPO).as_posix()
    for i, attr in enumerate(attrs):
        node = names.get(attr)
        if node is None:
            where = rel if i == 0 else f"{rel}: {'.'.join(attrs[:i])}"
            return f"{where} defines no {attr!r}"
        if not isinstance(node, ast.ClassDef):
            return None  # a function's or a value's own attributes are not followed
        names = _names_in(node.body)
    return None


def _module_file(parts: list[str]) -> tuple[Path | None, int]:
    """The file of the longest importable prefix of a dotted megatron_search name, and its length."""
    found, used = None, 0
    base = REPO / "megatron_search"
    if (base / "__init__.py").is_file():
        found, used = base / "__init__.py", 1
    for i, part in enumerate(parts[1:], start=2):
        if base is None:
            break
        if i == 2 and part == "kernels":  # the kernels/ folder, imported as megatron_search.kernels
            base, found, used = REPO / "kernels", REPO / "megatron_search" / "kernels" / "__init__.py", i
        elif (base / part / "__init__.py").is_file():
            base, found, used = base / part, base / part / "__init__.py", i
        elif (base / f"{part}.py").is_file():
            base, found, used = None, base / f"{part}.py", i
        else:
            break
    return found, used


def module_problem(name: str) -> str | None:
    """Why the dotted name (a module, or a module then attributes) cannot be found; None when it can."""
    parts = name.split(".")
    module_file, used = _module_file(parts)
    if module_file is None:
        return "no such module"
    if used == len(parts):
        return None
    problem = _attribute_problem(module_file, parts[used:])
    if problem and module_file.name == "__init__.py":
        return f"no such module, and {problem}"
    return problem


def _expand_braces(token: str) -> list[str]:
    pieces = re.split(r"(\{[^{}]*\})", token)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in pieces]
    return ["".join(choice) for choice in itertools.product(*options)]


def _extension(path: str) -> str:
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last.rsplit(".", 1)[1] if "." in last else ""


def _candidates(doc: Path, path: str) -> list[Path] | None:
    """Where `path` would live if it is one of ours (first match wins), or None when it is not ours."""
    first = path.split("/", 1)[0]
    doc_dir = doc.parent
    if first == "..":
        target = (doc_dir / path).resolve()
        return [target]
    if "/" not in path.rstrip("/"):
        return None  # bare names: see _bare_problem
    if first in ROOTS:
        return [REPO / path]
    beside = {p.name for p in doc_dir.iterdir() if p.is_dir()} - SKIP_DIRS - ROOTS
    if first in beside:
        return [doc_dir / path]
    ext = _extension(path)
    # Short paths from megatron_search/: only files of a checked kind or folders written with a trailing
    # slash, so that TensorBoard tags (`train/loss`, `rollout/count`) are left alone.
    if first in _packages() and (ext in CHECKED_EXT or path.endswith("/") or _attribute_split(path)):
        return [REPO / "megatron_search" / path]
    return None


def _attribute_split(path: str) -> tuple[str, list[str]] | None:
    """`rl/advantages.filtered_groups` -> ('rl/advantages.py', ['filtered_groups']); None otherwise."""
    head, _, last = path.rpartition("/")
    stem, dot, attrs = last.partition(".")
    if not dot or not attrs or attrs.split(".")[0] in CHECKED_EXT | {"jsonl", "csv", "tsv", "parquet", "arrow"}:
        return None
    if not all(a.isidentifier() for a in attrs.split(".")):
        return None
    return f"{head}/{stem}.py", attrs.split(".")


def path_problem(doc: Path, path: str) -> str | None:
    """Why `path` (as written in doc) names nothing of ours; None when it exists or is not ours."""
    candidates = _candidates(doc, path)
    if candidates is None:
        return None
    target = candidates[0]
    try:
        target.resolve().relative_to(REPO)
    except ValueError:
        return "outside the repository"
    if any(c in path for c in "*?"):
        return None if glob.glob(str(target)) else "the pattern matches no file"
    if target.exists():
        return None
    split = _attribute_split(path)
    if split is not None:
        module_file = target.parent / split[0].rsplit("/", 1)[1]
        if module_file.is_file():
            return _attribute_problem(module_file, split[1])
        return "no such module"
    return "no such file or folder"


def _bare_problem(doc: Path, name: str) -> str | None:
    """A bare source file name (`send_plan.py`, `lib.sh`) or doc name in capitals (`SLURM.md`) must be a file
    beside the doc or somewhere in the checkout; other bare names (`report.md`, `cfg.yaml`) are run outputs
    and placeholders."""
    if not re.fullmatch(r"[\w-]+\.(py|sh)|[A-Z][A-Z0-9_]*\.md", name):
        return None
    if (doc.parent / name).exists() or name in _file_names():
        return None
    return "no file of that name in the repository"


def _clean(token: str) -> str:
    token = token.rstrip(".,:;")
    if token.startswith("./"):
        token = token[2:]
    return token


def references(doc: Path) -> list[tuple[int, str, str]]:
    """(line, reference, why) for every reference in doc that names nothing of ours."""
    bad = []
    for lineno, line in enumerate(doc.read_text().splitlines(), start=1):
        for m in LINK.finditer(line):
            target = m[1].split("#", 1)[0]
            if target and not URL.match(target) and not (doc.parent / target).exists():
                bad.append((lineno, m[1], "link target missing, relative to the doc's own folder"))
        line = URL.sub(" ", line)
        for m in NODE_ID.finditer(line):
            file, rest = _clean(m[1]), m[2].split("::")
            problem = path_problem(doc, file)
            if problem is None and (REPO / file).is_file():
                problem = _attribute_problem(REPO / file, rest)
            if problem:
                bad.append((lineno, m[0], problem))
        line = NODE_ID.sub(" ", line)
        for m in MODULE.finditer(line):
            problem = module_problem(m[0])
            if problem:
                bad.append((lineno, m[0], problem))
        for m in TOKEN.finditer(line):
            token = _clean(m[0])
            if not token or token.startswith("/") or any(c in token for c in "<>$~") or "..." in token:
                continue
            if token.startswith("megatron_search.") and "/" not in token:
                continue  # dotted names: checked above
            if "/" not in token:
                problem = _bare_problem(doc, token)
                if problem:
                    bad.append((lineno, token, problem))
                continue
            for path in _expand_braces(token):
                problem = path_problem(doc, path)
                if problem:
                    bad.append((lineno, path, problem))
    return bad


def test_the_roots_exist():
    missing = sorted(r for r in ROOTS if not (REPO / r).exists())
    assert not missing, f"tests/test_docs_paths.py names top-level entries the checkout lacks: {missing}"


def test_every_path_and_module_the_docs_name_exists():
    bad = [f"{doc.relative_to(REPO)}:{line}: {ref} ({why})" for doc in DOCS for line, ref, why in references(doc)]
    assert not bad, f"{len(bad)} stale reference(s) in README.md / docs/*.md:\n" + "\n".join(bad)


def test_the_checker_tells_good_from_stale(tmp_path):
    """The rules above on a few lines, so that a change to them cannot silently pass everything."""
    doc = REPO / "docs" / "ARCHITECTURE.md"
    assert path_problem(doc, "train/grpo_run.py") is None
    assert path_problem(doc, "megatron_search/train/grpo_run.py") is None
    assert path_problem(doc, "img/eval_budget_demo.png") is None
    assert path_problem(doc, "train/no_such_module.py") == "no such file or folder"
    assert path_problem(doc, "tools/no_such_tool.py") == "no such file or folder"
    assert path_problem(doc, "rl/advantages.no_such_name") == "megatron_search/rl/advantages.py defines no 'no_such_name'"
    assert path_problem(doc, "../../outside.md") == "outside the repository"
    assert path_problem(doc, "configs/qwen3_30b_a3b_*.yaml") is None
    assert path_problem(doc, "configs/no_such_*.yaml") == "the pattern matches no file"
    for not_ours in ("train/loss", "rollout/count", "runs/demo/report.md", "a/train.jsonl", "data/sft.jsonl",
                     "srt/utils/auth.py", "vllm/engine/arg_utils.py"):
        assert path_problem(doc, not_ours) is None, not_ours
    assert module_problem("megatron_search.rollout.local.server") is None
    assert module_problem("megatron_search.kernels") is None
    assert module_problem("megatron_search.rm.build.preference_service") is None
    assert module_problem("megatron_search.nope") == "no such module, and megatron_search/__init__.py defines no 'nope'"
    assert module_problem("megatron_search.rm.build.nope") == "megatron_search/rm/build.py defines no 'nope'"
    assert _bare_problem(doc, "send_plan.py") is None
    assert _bare_problem(doc, "no_such_file.py") is not None
    sample = tmp_path / "x.md"
    sample.write_text("see `tools/gone.py`, https://example.com/tools/gone.py, `<output_dir>/x.py`,\n"
                      "`megatron_search.weights.gone` and `tests/test_docs_paths.py::no_such_test`\n"
                      "[fine](https://example.com/x.md), [here](x.md#top), [gone](docs/GONE.md)\n")
    found = [(line, ref) for line, ref, _ in references(sample)]
    assert found == [(1, "tools/gone.py"), (2, "tests/test_docs_paths.py::no_such_test"),
                     (2, "megatron_search.weights.gone"), (3, "docs/GONE.md"), (3, "docs/GONE.md")], found
