"""Measured numbers belong in docs (docs/performance.md, docs/serving.md, docs/reproduce.md), where they are dated and
re-measured, not in comments and docstrings, where they go stale unseen. The patterns are those of measurements
("0.6x", "106 -> 122", "122 requests/s", "about 3 s"), not of defaults or limits."""

import re

import pytest

from tests.unit.test_import_rules import ROOT

MEASURED = re.compile(r"\b(?!0x)\d+(\.\d+)?x\b|\d+(\.\d+)? ?(requests|tokens|req)/s\b|\b\d+(\.\d+)? -> \d+"
                      r"|\babout \d+(\.\d+)? ?(ms|s|µs)\b")
CODE = sorted(p for d in ("mbd", "actors", "serve_app", "pipelines") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_number_in_the_code(path):
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if MEASURED.search(line)]
    assert not hits, "measured numbers go in docs/performance.md:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", ["served 0.6x the requests", "106 -> 122 requests/s", "about 3 s of CPU"])
def test_the_patterns_catch_measurements(text):
    assert MEASURED.search(text)
