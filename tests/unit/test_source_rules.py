"""House rules read from the source (tests aside): a source file stays within 500 lines, so each keeps one job; a
function stays within 60 lines (counted from its `def` to its last line), so each does one thing."""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    """The project's Python files as git sees them (tracked, or new and not ignored): a run's outputs under the
    ignored runs/ (DeepSpeed writes a zero_to_fp32.py beside each checkpoint) are not source."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in sorted(listed) if Path(p).parts[0] != "tests" and (ROOT / p).is_file()]


def long_functions(path: Path, source: str) -> dict[str, int]:
    """'file: Class.function' -> lines, for every function (methods and nested ones included) over the limit."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(ROOT)}: {name}"] = n
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_source_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_function_is_over_60_lines():
    long = {name: n for p in sources() for name, n in long_functions(p, p.read_text()).items()}
    assert long == {}


def test_the_function_rule_counts_from_def_to_the_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    fits = f"class A:\n    def f(self):\n{body.replace('    ', '        ')}\n"  # 60 lines with its def
    over = f"def g():\n{body}\n    return 0\n"  # 61
    assert long_functions(ROOT / "probe.py", fits) == {}
    assert long_functions(ROOT / "probe.py", over) == {"probe.py: g": 61}
