"""The layering rules, read from the source with `ast` (nothing is imported, so a rule broken inside a function
body counts too):
- the core `mbd/` is plain PyTorch: it never imports Ray, FastAPI, DeepSpeed or the project's outer layers;
- the sandboxed child's files (`mbd/eval/sandbox_child.py`, `value_codec.py`) import only the standard library;
- the service (`serve_app/`, `actors/`) imports no pipeline: the `mbd serve` command lives in `pipelines/`; the one
  exception is `pipelines/ray_private.py`, the one place that reaches into Ray's private API, which the service
  needs too (a metric's zero series, the handle's gRPC path) and which imports nothing of the project;
- a pipeline (a module an `mbd` command runs, `pipelines/cli.py`) uses another pipeline only through the names
  it lists in `__all__` (its `run_*` entry point and config models); the other modules of `pipelines/` are
  libraries the pipelines share (`stages.py`, `ray_session.py`, ...), usable by any public name.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE_FORBIDDEN = ("ray", "fastapi", "starlette", "deepspeed", "pipelines", "actors", "serve_app", "benchmarks")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imports(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in the source; `import a.b` gives names []."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return out


def declared_all(path: Path) -> set[str] | None:
    """The literal `__all__` of a module, or None when it declares none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def command_modules() -> set[str]:
    """The modules `mbd <command>` runs, read from the literal SUBCOMMANDS table of pipelines/cli.py."""
    for node in ast.parse((ROOT / "pipelines" / "cli.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "SUBCOMMANDS":
            return {module for module, _ in ast.literal_eval(node.value).values()}
    raise AssertionError("pipelines/cli.py has no SUBCOMMANDS table")


def cross_pipeline_violations(path: Path, source: str) -> list[str]:
    me = module_name(path)
    bad = []
    for line, module, names in imports(source):
        if not module.startswith("pipelines.") or module == me:
            continue
        where = f"{path.relative_to(ROOT)}:{line}"
        if not names:
            bad.append(f"{where}: `import {module}` (import its public names instead)")
        elif module not in command_modules():
            bad += [f"{where}: private {module}.{n}" for n in names if n.startswith("_")]
        else:
            public = declared_all(ROOT / Path(*module.split(".")).with_suffix(".py")) or set()
            bad += [f"{where}: {module}.{n} is not in its __all__" for n in names if n not in public]
    return bad


def test_core_never_imports_ray_fastapi_deepspeed_or_outer_layers():
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in sorted((ROOT / "mbd").rglob("*.py"))
           for line, module, _ in imports(p.read_text()) if module.split(".")[0] in CORE_FORBIDDEN]
    assert bad == []


def test_ray_private_imports_nothing_of_the_project():
    """What lets the service import it: it drags no pipeline (nor anything else of ours) in."""
    mods = [m for _, m, _ in imports((ROOT / "pipelines" / "ray_private.py").read_text())]
    assert not [m for m in mods if m.split(".")[0] in ("mbd", "actors", "serve_app", "pipelines")]


def test_the_service_imports_no_pipeline():
    service = [p for d in ("serve_app", "actors") for p in sorted((ROOT / d).glob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in service
           for line, module, _ in imports(p.read_text())
           if module.split(".")[0] == "pipelines" and module != "pipelines.ray_private"]
    assert bad == []


def test_pipelines_use_each_other_only_through_their_public_surface():
    bad = [v for p in sorted((ROOT / "pipelines").glob("*.py")) for v in cross_pipeline_violations(p, p.read_text())]
    assert bad == []


def test_every_public_surface_names_what_the_module_defines():
    for p in sorted((ROOT / "pipelines").glob("*.py")):
        public = declared_all(p)
        if public is not None:
            assert public <= top_level_names(p), f"{p.name}: __all__ names {public - top_level_names(p)}"


@pytest.mark.parametrize("source, expected", [
    ("from pipelines.quickstart import write_corpus\n", ["quickstart.write_corpus is not in its __all__"]),
    ("import pipelines.train_multitf\n", ["`import pipelines.train_multitf`"]),
    ("from pipelines.stages import _private\n", ["private pipelines.stages._private"]),
    ("def f():\n    from pipelines.eval_sweep import run_sweep\n", []),
])
def test_the_rule_catches_a_private_import(source, expected):
    """The checker itself, on a pipeline module written here: a helper outside `__all__`, a whole-module import
    and a private name of a shared module are caught; a lazy import of an entry point is allowed."""
    found = cross_pipeline_violations(ROOT / "pipelines" / "probe.py", source)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found))


def test_the_sandboxed_childs_files_import_only_the_standard_library():
    """The child runs in a view without the repository: its runtime and the codec it loads by path may import
    nothing else (the codec imports numpy only to decode numpy values, which exist only where numpy does)."""
    import sys

    for name, allowed in (("sandbox_child.py", set()), ("value_codec.py", {"numpy"})):
        source = (ROOT / "mbd" / "eval" / name).read_text()
        outside = {m for _, m, _ in imports(source) if m.split(".")[0] not in sys.stdlib_module_names} - allowed
        assert outside == set(), f"{name} imports {outside}"


def test_rays_private_api_is_reached_from_one_module():
    """Ray's private names (its `_private` package, a metric's `_record`, a handle's `_by_reference` option) appear
    only in pipelines/ray_private.py, which says why each is needed and how a Ray upgrade that moves it is caught."""
    private = re.compile(r"ray\._private|(?<!self)\._record\(|_by_reference")  # our own `self._record` is ours
    found = [f"{path.relative_to(ROOT)}:{i}" for pkg in ("mbd", "actors", "serve_app", "pipelines")
             for path in (ROOT / pkg).rglob("*.py") if path != ROOT / "pipelines" / "ray_private.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert found == []
