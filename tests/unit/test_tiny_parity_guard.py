"""The parity guard (`python -m benchmarks.tiny_parity`) measures the present: its stored results are keyed by the
hash of the code and config that produced them, and it passes on the 95% interval's lower bound, not on a mean.
Synthetic results only; nothing trains here."""

from pathlib import Path

import pytest

from benchmarks.tiny_parity import code_hash, passes, run_key
from pipelines.stages import DEFAULT_CONFIG, load_config


def _tree(root: Path) -> Path:
    for rel, text in {"mbd/a.py": "x = 1\n", "mbd/assets/w.bin": "weights", "pipelines/b.py": "y = 2\n",
                      "configs/c.yaml": "steps: 800\n", "benchmarks/tiny_parity.py": "z = 3\n",
                      "docs/d.md": "prose\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_code_hash_changes_with_any_file_that_trains_decodes_or_judges(tmp_path):
    root = _tree(tmp_path)
    before = code_hash(root)
    assert code_hash(root) == before
    (root / "docs/d.md").write_text("other prose\n")  # not on the path
    (root / "mbd/__pycache__").mkdir()
    (root / "mbd/__pycache__/a.cpython-311.pyc").write_bytes(b"\0")
    assert code_hash(root) == before
    for rel in ("mbd/a.py", "mbd/assets/w.bin", "pipelines/b.py", "configs/c.yaml", "benchmarks/tiny_parity.py"):
        old = (root / rel).read_text()
        (root / rel).write_text(old + " ")
        assert code_hash(root) != before, rel
        (root / rel).write_text(old)
    assert code_hash(root) == before
    (root / "pipelines/new.py").write_text("")  # a new file is a change too
    assert code_hash(root) != before


def test_run_key_follows_code_config_and_problems_not_where_it_writes():
    cfg = load_config(DEFAULT_CONFIG)
    key = run_key(cfg, 10000, "c0de")
    assert run_key(load_config(DEFAULT_CONFIG), 10000, "c0de") == key
    assert run_key(cfg, 10000, "c0df") != key  # a code change never replays a stored verdict
    assert run_key(load_config(DEFAULT_CONFIG, ["train.lr=2e-3"]), 10000, "c0de") != key  # --set is honoured
    assert run_key(cfg, 1000, "c0de") != key
    assert run_key(load_config(DEFAULT_CONFIG, ["run_dir=x", "num_cpus=8"]), 10000, "c0de") == key


def _result(seeds: list[tuple[float, float]], tpf: float, over: tuple[float, float] | None = None) -> dict:
    """per-seed (diff, ci_low) and, for several seeds, the seed-level (mean, ci_low)."""
    r = {"per_seed": [{"diff_pp": d, "ci_low_pp": lo} for d, lo in seeds],
         "mean_diff_pp": sum(d for d, _ in seeds) / len(seeds), "mean_tpf_ratio": tpf}
    if over is not None:
        r["over_seeds"] = {"mean": over[0], "ci_low": over[1]}
    return r


@pytest.mark.parametrize("result, ok", [
    # docs/reproduce.md arm A: mean +1.44 pp (a mean rule passes it) but its interval starts at -6.55 pp
    (_result([(-2.16, -2.98), (2.71, 2.00), (3.78, 2.97)], 2.22, (1.44, -6.55)), False),
    # the five seeds of the fixed corpus: +1.31 pp [-0.66, +3.27]
    (_result([(1.12, .35), (3.81, 3.09), (1.42, .69), (-.39, -1.1), (.58, -.2)], 2.22, (1.31, -0.66)), True),
    # claim (a)'s TPF target, 1.78x (tab:tps_comparison's 6.19 / 3.47)
    (_result([(1.12, .35), (3.81, 3.09), (1.42, .69), (-.39, -1.1), (.58, -.2)], 1.77, (1.31, -0.66)), False),
    (_result([(0.0, -1.0)], 1.78), True),  # the bounds themselves pass
    (_result([(0.2, -1.01)], 2.5), False),  # one seed: its interval over the problems
])
def test_pass_rule_is_the_lower_bound_at_the_tpf_target(result, ok):
    assert passes(result) is ok
