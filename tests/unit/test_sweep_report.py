"""Sweep planning/store and report numbers, from hand-made records (no Ray, no model except one tiny engine)."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from mbd.config import ConfigError
from mbd.eval.metrics import AupPoint, aup, aup_d3llm, mean_aup
from mbd.eval.plots import plot_accuracy_vs_tpf, plot_noise_activity
from mbd.eval.report import (CellMetrics, Layout, Row, activity_profile, active_counts, aggregate, build_report, display,
                             mask_ratios_by_rank)
from mbd.eval.sweep_report import write_sweep_report
from mbd.eval.sweep import ItemRecord, PrefixCacheRecord, ResultStore, SweepConfig, load_problems
from mbd.eval.sweep_work import WorkQueue, plan_units

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(model, config, bench, pid, correct, gen, nfe, wall=1.0, lat=10.0):
    return ItemRecord(model=model, config=config, benchmark=bench, problem_id=pid, completion="", correct=correct,
                      nfe=nfe, num_generated=gen, tpf=gen / nfe, wall_time_s=wall, step_latency_ms=lat,
                      finish_reason="eos")


def records():
    """Model m: configs a, b, c on gsm8k and tinymath (two problems each); a and b form curve 'x'."""
    out = []
    # (config, bench): [(correct, generated, nfe, wall, step_latency_ms)] per problem
    table = {
        ("a", "gsm8k"): [(True, 10, 10, 1.0, 50.0), (False, 20, 10, 2.0, 100.0)],  # acc 50, tpf 1.5
        ("a", "tinymath"): [(True, 8, 8, 1.0, 10.0), (True, 8, 8, 1.0, 10.0)],  # acc 100, tpf 1.0
        ("b", "gsm8k"): [(False, 30, 10, 1.0, 20.0), (False, 30, 10, 1.0, 20.0)],  # acc 0, tpf 3.0
        ("b", "tinymath"): [(True, 8, 4, 1.0, 30.0), (False, 8, 4, 1.0, 30.0)],  # acc 50, tpf 2.0
        ("c", "gsm8k"): [(True, 40, 10, 1.0, 5.0), (True, 40, 10, 1.0, 5.0)],  # acc 100, tpf 4.0
        ("c", "tinymath"): [(True, 10, 2, 1.0, 5.0), (True, 10, 2, 1.0, 5.0)],  # acc 100, tpf 5.0
    }
    for (config, bench), rows in table.items():
        for i, (ok, gen, nfe, wall, lat) in enumerate(rows):
            out.append(rec("m", config, bench, f"{bench}/{i}", ok, gen, nfe, wall, lat))
    return out


def layout():
    return Layout(rows=[Row(model="m", config="a", section="m", curve="x"), Row(model="m", config="b", section="m",
                                                                              curve="x"),
                        Row(model="m", config="c", section="m", curve="y")], benchmarks=["gsm8k", "tinymath"])


def parse_table(md: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()[2:]]
    return {r[0]: r[1:] for r in rows}


def test_aggregate_hand_computed():
    cells = {(c.config, c.benchmark): c for c in aggregate(records())}
    a = cells[("a", "gsm8k")]
    assert (a.n, a.accuracy, a.tpf) == (2, 50.0, 1.5)
    assert a.tps == pytest.approx(30 / 3.0)  # tokens / summed request latency
    assert a.step_latency_ms == pytest.approx((50 * 10 + 100 * 10) / 20)  # NFE-weighted
    assert cells[("b", "tinymath")].tpf == 2.0 and cells[("b", "tinymath")].accuracy == 50.0


def test_main_table_numbers_and_aup():
    cells = aggregate(records())
    report = build_report(cells, layout())
    t = parse_table(report.main_table)
    assert t["**m**"] == [""] * 8
    # per benchmark Acc, TPF, then Avg Acc, Avg TPF (means over benchmarks, as the paper's Average column)
    assert t["a"][:6] == ["50.00", "1.50", "100.00", "1.00", "75.00", "1.25"]
    assert t["b"][:6] == ["0.00", "3.00", "50.00", "2.00", "25.00", "2.50"]
    # curve x = {a, b}: trapezoids per benchmark, averaged; hand: gsm8k (50+0)/2*1.5, tinymath (100+50)/2*1
    by = {(c.config, c.benchmark): c for c in cells}
    pts = {b: [AupPoint(tpf=by[(k, b)].tpf, accuracy=by[(k, b)].accuracy) for k in "ab"] for b in ("gsm8k", "tinymath")}
    assert mean_aup(pts) == pytest.approx((37.5 + 75.0) / 2)
    assert t["a"][6] == t["b"][6] == f"{mean_aup(pts):.2f}"
    assert t["c"][6] == "–"  # a one-point curve has no AUP
    x = next(c for c in report.curves if c.curve == "x")
    assert x.per_benchmark == {"gsm8k": aup(pts["gsm8k"]), "tinymath": aup(pts["tinymath"])}
    aup_rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.aup_table.splitlines()[2:]]
    # beside it d3LLM's variant, y_max = the section's best accuracy per benchmark (c: 100 on both)
    d3 = [aup_d3llm(pts[b], y_max=100.0) for b in ("gsm8k", "tinymath")]
    assert t["a"][7] == f"{np.mean(d3):.2f}" and t["c"][7] == "–"
    assert aup_rows == [["m", "x", "a, b", f"{aup(pts['gsm8k']):.2f}", f"{aup(pts['tinymath']):.2f}",
                         f"{mean_aup(pts):.2f}", f"{d3[0]:.2f}", f"{d3[1]:.2f}", f"{np.mean(d3):.2f}"],
                        ["m", "y", "c"] + ["–"] * 6]


def test_default_layout_is_one_curve_per_model_and_method():
    """Without explicit curves every (model, method) row has its own curve; before, a whole section
    shared one curve and every row showed the same AUP."""
    report = build_report(aggregate(records()))
    assert [c.curve for c in report.curves] == ["m:a", "m:b", "m:c"]
    assert all(c.mean is None for c in report.curves)  # one point each: no area
    assert len({r[6] for name, r in parse_table(report.main_table).items() if name in "abc"}) == 1  # all "–"


def test_sweep_grid_points_extend_their_row_curve(tmp_path):
    """A `sweep:` grid adds hidden points to the row's own curve; the table shows the operating point only."""
    cfg = sweep_cfg(tmp_path, decoding=[
        {"name": "a", "config": "configs/decode/tiny_singlebd.yaml", "sweep": {"tau_m2t": [0.8]}},
        {"name": "b", "config": "configs/decode/tiny_multibd.yaml", "sweep": {"tau_m2t": [0.8, 0.7], "tau_add": [0.3]}}])
    names = [d.name for _, d in cfg.pairs()]
    assert names == ["a", "a+tau_m2t=0.8", "b", "b+tau_m2t=0.8+tau_add=0.3", "b+tau_m2t=0.7+tau_add=0.3"]
    point = cfg.pairs()[3][1]
    assert point.params("math").tau_m2t == 0.8 and point.params("math").tau_add == 0.3
    layout = Layout.from_sweep(cfg)
    assert [(r.config, r.curve, r.shown) for r in layout.rows] == [
        ("a", "m:a", True), ("a+tau_m2t=0.8", "m:a", False), ("b", "m:b", True),
        ("b+tau_m2t=0.8+tau_add=0.3", "m:b", False), ("b+tau_m2t=0.7+tau_add=0.3", "m:b", False)]
    # hand-made cells: a at (1, 80) and its point at (2, 60) -> AUP (80 + 60) / 2 * 1 = 70; b's curve is complete
    cell = lambda c, tpf, acc: CellMetrics(model="m", config=c, benchmark="tinymath", n=5, accuracy=acc, tpf=tpf,
                                           tps=1.0, step_latency_ms=1.0)
    report = build_report([cell("a", 1, 80), cell("a+tau_m2t=0.8", 2, 60), cell("b", 2, 70),
                           cell("b+tau_m2t=0.8+tau_add=0.3", 3, 60), cell("b+tau_m2t=0.7+tau_add=0.3", 4, 40)], layout)
    t = parse_table(report.main_table)
    assert set(t) == {"**m**", "a", "b"}
    assert t["a"][4] == "70.00" and t["b"][4] == f"{(70 + 60) / 2 + (60 + 40) / 2:.2f}"
    with pytest.raises(ValidationError, match="sweep.tau_m2t"):
        sweep_cfg(tmp_path, decoding=[{"name": "a", "config": "configs/decode/tiny_singlebd.yaml",
                                       "sweep": {"tau_m2t": [1.5]}}])


def test_throughput_table_gains_against_section_baseline():
    report = build_report(aggregate(records()), layout())
    t = parse_table(report.tps_table)
    # columns: Avg TPF, TPF Gain, Step Lat, Lat Cost, gsm8k TPS, tinymath TPS, Avg TPS, TPS Gain
    assert t["a"][:4] == ["1.25", "--", "42.50", "1.00×"]  # step latency: mean of 75 and 10
    assert t["c"][0] == "4.50" and t["c"][1] == f"{100 * (4.5 / 1.25 - 1):+.2f}%"
    assert t["c"][3] == f"{5.0 / 42.5:.2f}×"
    tps_a = [30 / 3.0, 16 / 2.0]
    assert t["a"][4:7] == [f"{tps_a[0]:.2f}", f"{tps_a[1]:.2f}", f"{np.mean(tps_a):.2f}"]


def test_missing_cell_blanks_the_averages():
    rs = [r for r in records() if not (r.config == "b" and r.benchmark == "tinymath")]
    report = build_report(aggregate(rs), layout())
    t = parse_table(report.main_table)
    assert t["b"][2:] == ["–"] * 6  # no tinymath cell -> no average and no curve AUP
    assert next(c for c in report.curves if c.curve == "x").per_benchmark["gsm8k"] is not None


def trace(states_per_step):
    """Trace entries as mbd.decoding.trace.step_entry writes them (ratios only on ACTIVE slots)."""
    return [{"states": [s for s, _ in step], "mask_ratio": [r if s == "ACTIVE" else None for s, r in step],
             "prefix_len": 0} for step in states_per_step]


TRACE_A = trace([[("ACTIVE", 1.0), ("DUMMY", 1.0)], [("ACTIVE", 0.5), ("ACTIVE", 1.0)],
                 [("TO_CACHE", 0.0), ("ACTIVE", 0.25)], [("ACTIVE", 0.75), ("DUMMY", 1.0)]])
TRACE_B = trace([[("ACTIVE", 1.0), ("DUMMY", 1.0)], [("ACTIVE", 0.25), ("ACTIVE", 0.75)]])


def test_trace_statistics():
    assert active_counts(TRACE_A) == [1, 2, 1, 1]
    assert mask_ratios_by_rank([TRACE_A, TRACE_B]) == [[1.0, 0.5, 0.25, 0.75, 1.0, 0.25], [1.0, 0.75]]
    x, mean, std = activity_profile([TRACE_A, TRACE_B], bins=2)
    # first half: A steps 0,1 (1, 2) and B step 0 (1); second half: A steps 2,3 (1, 1) and B step 1 (2)
    assert list(x) == [0.25, 0.75]
    assert mean == pytest.approx([4 / 3, 4 / 3]) and std == pytest.approx([np.std([1, 2, 1])] * 2)
    quarters = activity_profile([TRACE_B], bins=4)[1]  # B's two steps sit at progress 0.25 and 0.75
    assert np.isnan(quarters[0]) and np.isnan(quarters[2]) and list(quarters[[1, 3]]) == [1.0, 2.0]


def test_plots_are_valid_pngs(tmp_path):
    import matplotlib.image

    report = build_report(aggregate(records()), layout())
    for path in (plot_accuracy_vs_tpf(report, tmp_path / "acc.png"),
                 plot_noise_activity({"m / a": [TRACE_A, TRACE_B], "m / b": [TRACE_B]}, tmp_path / "noise.png")):
        assert path.read_bytes()[:8] == PNG_MAGIC
        h, w, _ = matplotlib.image.imread(path).shape
        assert h > 100 and w > 100
    with pytest.raises(ValueError, match="trace_problems"):
        plot_noise_activity({"m / a": []}, tmp_path / "none.png")


# ------------------------------------------------------------------------------ config, store, planning


def sweep_cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), models=[{"name": "m", "path": str(tmp_path / "model")}],
                decoding=[{"name": "a", "config": "configs/decode/tiny_singlebd.yaml", "curve": "x"},
                          {"name": "b", "config": "configs/decode/tiny_multibd.yaml", "curve": "x",
                           "overrides": {"buffer_size": 2}}],
                benchmarks=[{"name": "tinymath", "limit": 5}], engine={"max_batch_rows": 2}, trace_problems=1)
    base.update(kw)
    return SweepConfig(**base)


@pytest.mark.parametrize("change, message", [
    (dict(benchmarks=["nope"]), "unknown benchmark 'nope'"),
    (dict(decoding=[{"name": "a", "config": "configs/decode/tiny_singlebd.yaml", "models": ["x"]}]),
     r"models \['x'\] are not in `models`"),
    (dict(decoding=[{"name": "a", "config": {"code": "configs/decode/tiny_singlebd.yaml"}}]), "no 'math' entry"),
    (dict(decoding=[{"name": "a", "config": "configs/decode/tiny_singlebd.yaml", "overrides": {"tau_m2t": 2}}]),
     "tau_m2t"),
    (dict(models=[{"name": "m", "path": "x"}, {"name": "m", "path": "y"}]), r"duplicate names \['m'\]"),
    (dict(models=[{"name": "bad/name", "path": "x"}]), "name"),
])
def test_config_errors_name_the_field(tmp_path, change, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        sweep_cfg(tmp_path, **change)


def test_store_resume_and_torn_line(tmp_path):
    store = ResultStore(tmp_path)
    for i in range(3):
        store.append(rec("m", "a", "tinymath", f"p{i}", True, 4, 2))
    path = store.path("m", "a", "tinymath")
    path.write_bytes(path.read_bytes()[:-7])  # an interrupted write: the third line is torn
    assert sorted(store.load("m", "a", "tinymath")) == ["p0", "p1"]
    store.append(rec("m", "a", "tinymath", "p2", False, 4, 2))  # appends after the repaired tail stay valid
    assert [json.loads(x)["problem_id"] for x in path.read_text().splitlines()] == ["p0", "p1", "p2"]
    path.write_text(path.read_text().replace('"p1"', '"p1'))
    with pytest.raises(ConfigError, match=r"tinymath.jsonl:2: corrupt record"):
        store.load("m", "a", "tinymath")


def test_plan_skips_stored_and_queue_prefers_held_engine(tmp_path):
    cfg = sweep_cfg(tmp_path, engine={"max_batch_rows": 1})  # units of 4 problems
    problems = load_problems(cfg)
    store = ResultStore(cfg.output_dir)
    store.append(rec("m", "a", "tinymath", problems["tinymath"][0].problem_id, True, 4, 2))
    units, skipped = plan_units(cfg, problems, store, {"tinymath": []})
    assert skipped == 1
    assert sum(len(u.problems) for u in units) == 2 * 5 - 1
    a_units = [u for u in units if u.cell.decode.name == "a"]
    assert [p.problem_id for u in a_units for p in u.problems] == [p.problem_id for p in problems["tinymath"][1:]]
    assert [k for u in a_units for k in u.keep_trace] == [False] * 4  # problem 0 (the only traced one) is stored
    assert [len(u.problems) for u in units] == [4, 4, 1]
    queue = WorkQueue(units)
    first = queue.pop()
    assert first.cell.decode.name == "b"  # the group with most problems left (b: 5, a: 4)
    assert queue.pop(a_units[0].key) is a_units[0]  # the worker holding a's engine gets a's unit
    assert queue.pop(a_units[0].key).key == first.key  # a is done: fall back to b
    assert len(queue) == 0 and queue.pop() is None


def test_write_sweep_report_from_store(tmp_path):
    cfg = sweep_cfg(tmp_path, benchmarks=[{"name": "tinymath", "limit": 2}])
    problems = load_problems(cfg)
    store = ResultStore(cfg.output_dir)
    pids = [p.problem_id for p in problems["tinymath"]]
    for config, (gen, nfe) in {"a": (8, 8), "b": (8, 4)}.items():
        for i, pid in enumerate(pids):
            store.append(rec("m", config, "tinymath", pid, i == 0, gen, nfe))
    store.append(rec("m", "a", "tinymath", "tinymath/not-in-this-sweep", False, 1, 1))  # ignored: not a problem now
    store.append_trace("m", "b", "tinymath", pids[0], TRACE_A)
    summary = write_sweep_report(cfg, problems, decoded=4, skipped=0, wall_s=1.0)
    assert {(c.config, c.n, c.tpf, c.accuracy) for c in summary.cells} == {("a", 2, 1.0, 50.0), ("b", 2, 2.0, 50.0)}
    expected = aup([AupPoint(tpf=1, accuracy=50), AupPoint(tpf=2, accuracy=50)])  # 50 * (2 - 1)
    assert parse_table(summary.table_markdown)["a"][-2] == f"{expected:.2f}" == "50.00"  # curve x (a, b)
    assert summary.table_markdown in open(summary.report_path).read()
    assert [p.split("/")[-1] for p in summary.plots] == ["accuracy_vs_tpf.png", "noise_activity.png"]
    import pyarrow.parquet as pq

    assert pq.read_table(summary.parquet_path).num_rows == 4
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["decoded"] == 4


# ------------------------------------------------------------------------------------------- prefix cache


def test_prefix_hit_rate_per_cell_and_in_the_throughput_table():
    lookups = {("m", "a", "gsm8k"): [PrefixCacheRecord(problem_ids=["gsm8k/0"], query_tokens=100, hit_tokens=75),
                                     PrefixCacheRecord(problem_ids=["gsm8k/1"], query_tokens=100, hit_tokens=25)],
               ("m", "a", "tinymath"): [PrefixCacheRecord(problem_ids=["tinymath/0"], query_tokens=0, hit_tokens=0)],
               ("m", "c", "gsm8k"): []}
    cells = {(c.config, c.benchmark): c.prefix_hit_rate for c in aggregate(records(), lookups)}
    # pooled over units: (75 + 25) / 200; no lookups made: 0; nothing stored: unknown
    assert cells == {("a", "gsm8k"): 0.5, ("a", "tinymath"): 0.0, ("b", "gsm8k"): None, ("b", "tinymath"): None,
                     ("c", "gsm8k"): None, ("c", "tinymath"): None}
    report = build_report(aggregate(records(), lookups), layout())
    assert report.tps_table.splitlines()[0].endswith("| Avg TPS | TPS Gain | Prefix Hit (%) |")
    t = parse_table(report.tps_table)
    assert t["a"][-1] == "25.0" and t["b"][-1] == "–"  # mean over benchmarks of 50% and 0%


def test_fewshot_columns_and_stored_lookups_in_the_sweep_report(tmp_path):
    cfg = sweep_cfg(tmp_path, benchmarks=[{"name": "tinymath", "limit": 2},
                                          {"name": "tinymath", "limit": 2, "fewshot": 1}])
    assert display("tinymath+1shot") == "tinymath (1shot)" and display("gsm8k+8shot+seed2") == "GSM8K (8shot, seed2)"
    problems = load_problems(cfg)
    assert list(problems) == ["tinymath", "tinymath+1shot"]
    store = ResultStore(cfg.output_dir)
    for label, ps in problems.items():
        for config in "ab":
            for p in ps:
                store.append(rec("m", config, label, p.problem_id, True, 8, 4))
    fs = [p.problem_id for p in problems["tinymath+1shot"]]
    store.append_prefix_cache("m", "a", "tinymath+1shot", PrefixCacheRecord(problem_ids=fs, query_tokens=64,
                                                                             hit_tokens=48))
    store.append_prefix_cache("m", "a", "tinymath+1shot", PrefixCacheRecord(  # another run's problems: ignored
        problem_ids=["tinymath/not-in-this-sweep"], query_tokens=64, hit_tokens=0))
    summary = write_sweep_report(cfg, problems)
    rates = {(c.config, c.benchmark): c.prefix_hit_rate for c in summary.cells}
    assert rates == {("a", "tinymath"): None, ("b", "tinymath"): None, ("a", "tinymath+1shot"): 0.75,
                     ("b", "tinymath+1shot"): None}
    assert "tinymath (1shot) Acc" in summary.table_markdown
    stored = json.loads((tmp_path / "out" / "summary.json").read_text())["cells"]
    assert {(c["config"], c["benchmark"]): c["prefix_hit_rate"] for c in stored} == rates


def test_fewshot_units_carry_the_same_exemplars_for_every_problem(tmp_path):
    from mbd.eval.sweep import load_splits

    cfg = sweep_cfg(tmp_path, engine={"max_batch_rows": 1}, benchmarks=[{"name": "tinymath", "limit": 5, "fewshot": 2}])
    splits = load_splits(cfg)
    units, _ = plan_units(cfg, {k: s.scored for k, s in splits.items()}, ResultStore(cfg.output_dir),
                          {k: s.exemplars for k, s in splits.items()})
    convs = [c for u in units for c in u.prompts()]
    assert len(convs) == 2 * 5
    turns = [{"role": r, "content": c} for e in splits["tinymath+2shot"].exemplars
             for r, c in (("user", e.prompt_text), ("assistant", e.solution))]
    assert all(c[:4] == turns and c[4:] == [{"role": "user", "content": p.prompt_text}]
               for c, p in zip(convs, splits["tinymath+2shot"].scored * 2))
