"""The pre-registration of an `mbd reproduce` run: how many training seeds each claim is judged over, and the rest
of the recipe, fixed in a file before anything trains.

A run's folder is named by its registration (the seed counts, readable, and a hash of every setting that decides a
result), so resuming with another seed count, step count or problem count starts a new run in a new folder with
its own verdicts: a judged run is never continued until its verdict turns (optional stopping). The key holds the
decode settings themselves (thresholds, buffer, block), read from the files `eval.singlebd` / `eval.multibd` name,
not just their paths. Where the run writes its output (run_dir) and how many CPUs it gets (num_cpus) decide no
result and stay out of the key; so does the quickstart's serve stage, which `mbd reproduce` never runs. The code's
commit is recorded beside the key, not in it: a commit that changes no setting may resume a run, and the report
says which commits it ran on.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel

from mbd.config import REPO_ROOT, ConfigError
from pipelines.stages import ClaimSeeds, QuickstartConfig

REGISTRATION = "registration.json"
UNKEYED = {"run_dir", "num_cpus", "serve"}


class Registration(BaseModel):
    claim_seeds: ClaimSeeds
    config: dict
    registered_at: str
    commit: str | None = None  # the code's git commit at registration ("+dirty": uncommitted changes)


def registered_config(cfg: QuickstartConfig) -> dict:
    out = cfg.model_dump(mode="json", exclude=UNKEYED)
    out["decode"] = {p: cfg.eval.points(p)[0].model_dump(mode="json") for p in (cfg.eval.singlebd, cfg.eval.multibd)}
    return out


def code_commit() -> str | None:
    """HEAD of the checkout this module runs from, "+dirty" when tracked files differ; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def registration_dir(cfg: QuickstartConfig, run_dir: Path) -> Path:
    """`run_dir`/a5-c5-d5-e5-<first 10 hex digits of the sha256 of the registered config>."""
    digest = hashlib.sha256(json.dumps(registered_config(cfg), sort_keys=True).encode()).hexdigest()[:10]
    counts = "-".join(f"{k}{v}" for k, v in cfg.claim_seeds.model_dump().items())
    return run_dir / f"{counts}-{digest}"


def register(cfg: QuickstartConfig, run_dir: Path) -> tuple[Path, Registration]:
    """The run's folder and its registration: written now if the folder is new, else read back and checked against
    `cfg` (a folder whose registration says otherwise was edited by hand and is refused)."""
    folder = registration_dir(cfg, run_dir)
    path = folder / REGISTRATION
    if path.is_file():
        reg = Registration.model_validate_json(path.read_text())
        if reg.config != registered_config(cfg):
            raise ConfigError(f"{path}: registers another config than this run's; a changed setting is a new run "
                              f"(its folder is named by the registration), so restore or delete that file")
        return folder, reg
    reg = Registration(claim_seeds=cfg.claim_seeds, config=registered_config(cfg),
                       registered_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=code_commit())
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(reg.model_dump_json(indent=2) + "\n")
    return folder, reg
