"""`mbd reproduce` pre-registers the training seeds of each claim: the run's folder is named by the registration,
and a claim is judged over exactly its registered seeds, so adding seeds to a finished run changes no verdict."""

import subprocess

import pytest

from mbd.config import REPO_ROOT, ConfigError, resolve_path
from mbd.eval.benchmarks import get_benchmark
from mbd.eval.sweep import ItemRecord, ResultStore
from pipelines.preregistration import REGISTRATION, register, registration_dir
from pipelines.reproduce import Run, claim_methods, judge_all, methods_for, registration_line, run_reproduce, runs_of
from pipelines.stages import DEFAULT_CONFIG, load_config

N = 2000  # claim problems
SINGLE_CORRECT = 1600  # SingleBD: 80.00%
# MBD - SingleBD in pp per training seed: the first three straddle the 1 pp margin, seeds 3 and 4 would settle it
DIFF_PP = {0: +2.0, 1: -1.5, 2: +2.5, 3: +1.0, 4: +1.5}


def _cfg(seeds: int, *sets: str):
    return load_config(DEFAULT_CONFIG, [f"eval.claim_problems={N}", *(f"claim_seeds.{c}={seeds}" for c in "acde"),
                                        *sets])


def _store(folder, model: str, correct: int, nfe: int) -> None:
    store = ResultStore(folder / "claims")
    for i, p in enumerate(get_benchmark("tinymath").load(limit=N)):
        store.append(ItemRecord(model=model, config=model if model != "base" else "x", benchmark="tinymath",
                                problem_id=p.problem_id, completion="", correct=i < correct, nfe=nfe,
                                num_generated=8, tpf=8 / nfe, wall_time_s=0.1, step_latency_ms=1.0,
                                finish_reason="eos"))


def _store_base(folder) -> None:
    store = ResultStore(folder / "claims")
    for config, correct, nfe in (("singlebd", SINGLE_CORRECT, 8), ("multibd-tf", 200, 2)):
        for i, p in enumerate(get_benchmark("tinymath").load(limit=N)):
            store.append(ItemRecord(model="base", config=config, benchmark="tinymath", problem_id=p.problem_id,
                                    completion="", correct=i < correct, nfe=nfe, num_generated=8, tpf=8 / nfe,
                                    wall_time_s=0.1, step_latency_ms=1.0, finish_reason="eos"))


def _store_chain(folder, seed: int) -> tuple[str, str]:
    model = Run("chain", seed, seed == 0).model
    _store(folder, model, SINGLE_CORRECT + round(DIFF_PP[seed] * N / 100), nfe=2)  # TPF 4 vs SingleBD's 1
    return model, model


def _judge(cfg, folder, stored):
    runs = runs_of(cfg, ["core"])
    keep = {m[3] for m in claim_methods(cfg, methods_for(cfg, runs), runs)}
    return judge_all(cfg, folder, runs, set(), {s for s in stored if s[0] in keep})


def test_adding_seeds_to_a_finished_run_changes_no_verdict(tmp_path):
    three, five = _cfg(3), _cfg(5)
    folder = registration_dir(three, tmp_path)
    _store_base(folder)
    stored = {("base", "singlebd"), ("base", "multibd-tf")} | {_store_chain(folder, s) for s in range(3)}
    judged = _judge(three, folder, stored)
    assert judged[0].verdict == "INCONCLUSIVE" and "over 3 seeds" in judged[0].evidence

    stored |= {_store_chain(folder, s) for s in (3, 4)}  # two more seeds trained into the same folder
    assert _judge(three, folder, stored) == judged  # every claim, evidence included, as registered
    # the same records judged over five seeds would have turned (a): the extra seeds are not ignored by accident
    turned = _judge(five, folder, stored)
    assert turned[0].verdict == "REPRODUCED" and "over 5 seeds" in turned[0].evidence
    # ... and five seeds are another registration: another folder, never this run continued
    assert registration_dir(five, tmp_path) != folder


def test_a_claim_missing_a_registered_seed_is_not_run(tmp_path):
    five = _cfg(5)
    folder = registration_dir(five, tmp_path)
    _store_base(folder)
    stored = {("base", "singlebd"), ("base", "multibd-tf")} | {_store_chain(folder, s) for s in range(3)}
    claims = {c.id: c.verdict for c in _judge(five, folder, stored)}
    assert claims["a"] == claims["c"] == "NOT RUN" and claims["b"] == "REPRODUCED"


def test_the_folder_is_keyed_by_every_setting_that_decides_a_result(tmp_path):
    base = registration_dir(_cfg(5), tmp_path)
    assert base.parent == tmp_path and base.name.startswith("a5-c5-d5-e5-")
    assert registration_dir(_cfg(5), tmp_path) == base
    assert registration_dir(_cfg(5, "claim_seeds.d=3"), tmp_path).name.startswith("a5-c5-d3-e5-")
    assert registration_dir(_cfg(5, "train.steps=100"), tmp_path) != base
    assert registration_dir(_cfg(5, "eval.problems=500"), tmp_path) != base
    # the decode settings the file holds, not only its path
    strict = tmp_path / "multibd.yaml"
    strict.write_text(resolve_path(_cfg(5).eval.multibd).read_text().replace("tau_add: 0.49", "tau_add: 0.25"))
    assert "tau_add: 0.25" in strict.read_text()
    assert registration_dir(_cfg(5, f"eval.multibd={strict}"), tmp_path) != base
    # where it writes and how many CPUs it gets decide no result
    assert registration_dir(_cfg(5, "run_dir=elsewhere", "num_cpus=8"), tmp_path) == base


def test_registration_is_written_once_and_checked_on_resume(tmp_path):
    cfg = _cfg(3)
    folder, reg = register(cfg, tmp_path)
    assert (folder / REGISTRATION).is_file() and reg.claim_seeds.a == 3
    # the code's commit, recorded outside the key (CI runs from a git clone)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    assert reg.commit.removesuffix("+dirty") == head and len(head) == 40
    again = register(cfg, tmp_path)[1]
    assert again.registered_at == reg.registered_at
    edited = reg.model_copy(update={"config": {**reg.config, "seed": 7}})
    (folder / REGISTRATION).write_text(edited.model_dump_json())
    with pytest.raises(ConfigError, match="registers another config"):
        register(cfg, tmp_path)


def test_report_states_the_counts_fixed_up_front(tmp_path):
    cfg = _cfg(5, "claim_seeds.d=3")
    line = registration_line(cfg, register(cfg, tmp_path)[1])
    assert "(a) 5, (c) 5, (d) 3, (e) 5" in line and "before any training" in line


def test_report_only_refuses_an_unregistered_run(tmp_path):
    with pytest.raises(ConfigError, match="no run registered"):
        run_reproduce(_cfg(4), tmp_path, ["core"], progress=False, report_only=True)
    assert not any(tmp_path.iterdir())


def test_wall_times_add_up_over_resumed_invocations_and_a_killed_step_adds_nothing(tmp_path, monkeypatch):
    """A resumed run's report shows what every finished step took, not what its last invocation redid in ~0 s."""
    import pipelines.stages as stages_module
    from pipelines.stages import Stages

    clock = iter([0.0, 400.0, 400.0, 1000.0, 1000.5, 1000.5, 1300.0])  # perf_counter at each start and end
    monkeypatch.setattr(stages_module.time, "perf_counter", lambda: next(clock))
    log = tmp_path / "wall_s.json"
    first = Stages(["train", "eval"], log=log)
    with first.run("train", "x"):
        pass
    with pytest.raises(KeyboardInterrupt), first.run("eval", "x"):  # killed mid-way: no end, nothing recorded
        raise KeyboardInterrupt
    assert first.total_s == {"train": 400.0}
    second = Stages(["train", "eval"], log=log)  # resumed: train is stored (0.5 s), eval runs again
    with second.run("train", "x"):
        pass
    with second.run("eval", "x"):
        pass
    assert second.wall_s == {"train": 0.5, "eval": 299.5}
    assert Stages([], log=log).total_s == {"train": 400.5, "eval": 299.5}
