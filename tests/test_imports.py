"""The import rules between the packages, checked on the source and in fresh interpreters.

- `grad_cache/` stands alone: importing it loads no module of the project but itself and the
  batching layer, which loads only itself; both import nothing but torch and the standard
  library, and the pair copied into another package runs a GradCache step there.
- The batching layer sits below the data side and the training engine: `datasets/` and
  `grad_cache/` both import it and never each other, not even through a third module.
- Each concept the pair took over exists once: the rest of the project names the same objects.
- The module import graph of the whole package has no cycle (a failure names one).

Module-level imports only (a function's own imports run when it is called, and `if TYPE_CHECKING`
blocks never run); importing `a.b.c` counts as importing the packages `a.b` and `a` too, as it
runs their `__init__` first.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "titan_contrastive"
ROOT = "titan_contrastive"
PAIR = ("grad_cache", "batching")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _runtime_statements(body: list[ast.stmt], functions: bool = False) -> list[ast.stmt]:
    """The statements that run when the module is imported, nested blocks included, `if
    TYPE_CHECKING:` blocks not; function bodies too with `functions` (what runs when called)."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if functions:
                out += _runtime_statements(node.body, functions)
            continue
        out.append(node)
        if isinstance(node, ast.If):
            checking = isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)
            out += ([] if checking else _runtime_statements(node.body, functions)) + _runtime_statements(
                node.orelse, functions
            )
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                out += _runtime_statements(block, functions)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            out += _runtime_statements(node.body, functions)
    return out


def imported(name: str, functions: bool = False) -> set[str]:
    """Every absolute module name `name` imports at module level, with `functions` in its functions too
    (relative imports resolved; for `from x import y`, both x and x.y, which may be a submodule)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in _runtime_statements(ast.parse(path.read_text(encoding="utf-8")).body, functions):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def graph(functions: bool = False) -> dict[str, set[str]]:
    """Module -> the project's modules importing it runs (ancestor packages included, except the
    module's own, which are already being imported when it runs); with `functions`, also those its
    functions import when called."""
    edges = {}
    for name in MODULES:
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        deps = set()
        for target in imported(name, functions):
            parts = target.split(".")
            deps.update(a for i in range(1, len(parts) + 1) if (a := ".".join(parts[:i])) in MODULES and a not in own)
        edges[name] = deps
    return edges


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in edges[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def in_package(name: str, *packages: str) -> bool:
    return any(name == f"{ROOT}.{p}" or name.startswith(f"{ROOT}.{p}.") for p in packages)


def loaded_by(statement: str) -> list[str]:
    """The project's modules in sys.modules after `statement` in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == '{ROOT}')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


# ---------------------------------------------------------------- grad_cache and batching stand alone


def test_grad_cache_imports_alone() -> None:
    loaded = loaded_by("import titan_contrastive.grad_cache")
    assert {f"{ROOT}.grad_cache", f"{ROOT}.batching"} <= set(loaded)
    assert [m for m in loaded if m != ROOT and not in_package(m, *PAIR)] == []


def test_batching_imports_alone() -> None:
    loaded = loaded_by("import titan_contrastive.batching")
    assert [m for m in loaded if m != ROOT and not in_package(m, "batching")] == []


def test_the_pair_imports_only_torch_and_the_standard_library() -> None:
    """On the source: no third-party package but torch, no module of the project outside the pair
    (batching not even grad_cache), and no context variable carrying state between calls (the
    locked-tower replay goes to the model as an argument)."""
    for name in MODULES:
        if not in_package(name, *PAIR):
            continue
        for target in imported(name):
            top = target.split(".")[0]
            assert top in sys.stdlib_module_names or top in ("torch", ROOT), f"{name} imports {target}"
            if top == ROOT:
                allowed = ("batching",) if in_package(name, "batching") else PAIR
                assert in_package(target, *allowed), f"{name} imports {target}"
            assert top != "contextvars", f"{name} imports contextvars"


def test_the_pair_runs_copied_into_another_package(tmp_path: Path) -> None:
    """`grad_cache/` and `batching/` copied side by side into a package of another project: a
    GradCache step runs there without the project installed or loaded."""
    package = tmp_path / "elsewhere"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in PAIR:
        shutil.copytree(PACKAGE / name, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    code = textwrap.dedent("""
        import sys
        import torch
        from elsewhere.grad_cache import GradCache

        model = torch.nn.Linear(4, 3)
        loss_fn = lambda q, p: (q @ p.T).logsumexp(1).mean()
        loss = GradCache([model, model], 2, loss_fn).cache_step(torch.randn(5, 4), torch.randn(5, 4))
        assert model.weight.grad is not None and torch.isfinite(loss)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "titan_contrastive"))
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_one_copy_of_each_name_the_pair_took_over() -> None:
    """The rest of the project names the pair's objects: one definition of each."""
    modules = {
        name: importlib.import_module(f"{ROOT}.{name}")
        for name in ("batching", "grad_cache", "grad_cache.rng", "grad_cache.sync", "parallelisms.collectives")
    }
    batching, grad_cache, rng = modules["batching"], modules["grad_cache"], modules["grad_cache.rng"]

    assert grad_cache.grad_sync is modules["grad_cache.sync"].grad_sync
    assert grad_cache.RandContext is rng.RandContext
    assert modules["parallelisms.collectives"].max_over_ranks is batching.max_over_ranks
    for name in ("split_inputs", "split_vlm_inputs", "right_trimmed", "token_chunks", "trim_padding"):
        assert getattr(grad_cache, name) is getattr(batching, name), name
    assert grad_cache.GradCacheError is batching.BatchError


# ---------------------------------------------------------------- the layers and the graph


def test_datasets_and_grad_cache_never_import_each_other() -> None:
    edges = graph()
    for name in MODULES:
        if in_package(name, "datasets"):
            assert not [m for m in reachable(edges, name) if in_package(m, "grad_cache")], name
        if in_package(name, "grad_cache"):
            assert not [m for m in reachable(edges, name) if in_package(m, "datasets")], name
    users = {name for name in MODULES if in_package(name, "datasets") and f"{ROOT}.batching" in edges[name]}
    assert {f"{ROOT}.datasets.layouts", f"{ROOT}.datasets.retrieval"} <= users


def test_the_import_graph_is_acyclic() -> None:
    edges = graph()
    assert len(edges) > 50 and f"{ROOT}.batching" in edges[f"{ROOT}.grad_cache"]  # the walk sees the package
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_hides_in_an_import_deferred_into_a_function() -> None:
    """A function-level import that leads back to its own module is a cycle postponed, not removed
    (the clip family once read checkpoints through a package that imported the family)."""
    edges = graph(functions=True)
    assert f"{ROOT}.models" in edges[f"{ROOT}.export"]  # export imports the registry when it runs
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle through a function: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_an_older_torch_is_refused_on_import() -> None:
    """An environment with a torch older than pyproject.toml's floor (a container's, or one installed with
    --no-deps) gets one line naming both versions, not an ImportError from inside DCP; a two-digit minor
    version is not compared as text."""
    from titan_contrastive import MIN_TORCH
    from titan_contrastive.config.manager import tomllib

    floor = ".".join(map(str, MIN_TORCH))
    assert f"torch>={floor}" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]

    def import_with(version: str) -> subprocess.CompletedProcess:
        code = f"import torch; torch.__version__ = {version!r}; import titan_contrastive"
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)

    old = import_with("2.8.0+cu128")
    assert old.returncode == 1
    assert old.stderr.strip().splitlines()[-1] == (
        f"ImportError: titan_contrastive needs torch >= {floor}, this is torch 2.8.0+cu128: "
        "install a newer torch built for your CUDA (README.md: GPU users) and run again"
    )
    assert import_with("2.10.0.dev20260101+cu130").returncode == 0
