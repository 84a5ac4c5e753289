"""A house rule read from the source: a source file (tests aside) stays within 500 lines, so each keeps one job."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_source_file_is_over_500_lines():
    sources = [p for p in sorted(ROOT.rglob("*.py")) if not {".venv", ".git", "tests"} & set(p.relative_to(ROOT).parts)]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
