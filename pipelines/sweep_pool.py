"""Where an evaluation sweep runs: one placement group that reserves every decoder actor and scoring slot up front.

Without a reservation the decoder actors can take every CPU of a cluster, and the scoring tasks then wait
forever, with no message, for a CPU nobody frees. So the sweep asks for everything at once (strategy SPREAD:
across nodes when there are several) and refuses at once, naming the shortfall, when the cluster's nodes can
never hold it. When a node is lost, `rebuild` reserves again on the nodes left (fewer decoders or scoring
slots if they no longer fit) and the driver redoes the lost work there. Every reservation and every loss is
appended to `<output_dir>/placement.jsonl`, for the operator (and the tests) to see where the work ran.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.eval_worker import EvalWorker
from mbd.config import ConfigError
from mbd.eval.sweep import SweepConfig

__all__ = ["DecoderPool", "PlacementError", "Shape", "fits", "plan_shape", "read_placement_log"]

MAX_DEFAULT_SCORERS = 64  # scoring slots reserved when `scorers` is unset: the CPUs left over, at most this many
NODE_DEATH_WAIT_S = 45.0  # after a worker is lost: how long to wait for the cluster to declare its node dead
PLACEMENT_LOG = "placement.jsonl"
EPS = 1e-9


class PlacementError(ConfigError):
    """The sweep's reservation cannot be placed (now or ever): the message names what is missing."""


@dataclass(frozen=True)
class Shape:
    """What one reservation holds: `decoders` bundles for decoder actors, then `scorers` scoring slots."""

    decoders: int
    scorers: int
    decoder: dict[str, float]
    scorer: dict[str, float]

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.decoder) for _ in range(self.decoders)] + [dict(self.scorer) for _ in range(self.scorers)]

    def describe(self) -> str:
        cpus = self.decoders * self.decoder.get("CPU", 0) + self.scorers * self.scorer.get("CPU", 0)
        return (f"{self.decoders} decoder(s) x {_fmt(self.decoder)} + {self.scorers} scoring slot(s) x "
                f"{_fmt(self.scorer)} ({cpus:g} CPU in all)")


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def fits(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> bool:
    """Whether the bundles can be packed into the nodes' resources (first fit, largest bundles first)."""
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: (b.get("GPU", 0), b.get("CPU", 0)), reverse=True):
        for f in free:
            if all(f.get(k, 0) + EPS >= v for k, v in b.items()):
                for k, v in b.items():
                    f[k] = f.get(k, 0) - v
                break
        else:
            return False
    return True


def alive_nodes() -> dict[str, dict[str, float]]:
    """Node id -> total resources, for the nodes the cluster counts alive."""
    return {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}


def device_and_decoders(cfg: SweepConfig) -> tuple[str, int]:
    """The decoding device and the number of decoder actors asked for (one per GPU by default)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = cfg.engine.device if cfg.engine.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise ConfigError("engine.device: cuda but the Ray cluster has no GPU; use device: cpu (or auto)")
    return device, cfg.workers or (gpus if device == "cuda" else 1)


def default_scorers(cfg: SweepConfig, decoders: int, free_cpu: float) -> int:
    """`scorers`, else as many scoring slots as the CPUs left free beside the decoders hold (at least one)."""
    return cfg.scorers or max(1, min(MAX_DEFAULT_SCORERS, math.floor(
        (free_cpu - decoders * cfg.cpus_per_worker + EPS) / cfg.cpus_per_scorer)))


def plan_shape(cfg: SweepConfig, device: str, decoders: int, scorers: int, nodes: list[dict[str, float]],
               shrink: bool) -> Shape:
    """The largest reservation up to `decoders` actors and `scorers` scoring slots that the nodes can hold.
    Without `shrink` only default scoring slots may be fewer; with it (after a node loss) decoders and scoring
    slots both, down to one each. Raises PlacementError naming the shortfall when not even that fits."""
    decoder = {"CPU": cfg.cpus_per_worker} | ({"GPU": 1.0} if device == "cuda" else {})
    scorer = {"CPU": cfg.cpus_per_scorer}
    decoder_counts = range(decoders, 0, -1) if shrink else [decoders]
    scorer_counts = [scorers] if cfg.scorers and not shrink else range(scorers, 0, -1)
    for d in decoder_counts:
        for s in scorer_counts:
            shape = Shape(d, s, decoder, scorer)
            if fits(shape.bundles(), nodes):
                return shape
    need = Shape(decoder_counts[-1], scorer_counts[-1], decoder, scorer)
    have = ", ".join(_fmt({k: v for k, v in n.items() if k in decoder}) for n in nodes) or "none"
    raise PlacementError(
        f"the sweep needs {need.describe()} but the cluster's {len(nodes)} node(s) can never hold that "
        f"(nodes: {have}); lower workers, cpus_per_worker, cpus_per_scorer or scorers, or add nodes")


class DecoderPool:
    """The placement group of a sweep, its decoder actors, and the scoring tasks it runs in its scoring slots."""

    def __init__(self, cfg: SweepConfig, max_decoders: int, reserve_timeout_s: float):
        self.cfg, self.reserve_timeout_s = cfg, reserve_timeout_s
        self.device, wanted = device_and_decoders(cfg)
        self.max_decoders = min(wanted, max_decoders)
        self.log_path = Path(cfg.output_dir) / PLACEMENT_LOG
        self.pg: PlacementGroup | None = None
        self.workers: list[Any] = []
        self.nodes: set[str] = set()  # the nodes alive when the group was reserved
        self.shape = self._reserve(shrink=False)

    def _reserve(self, shrink: bool) -> Shape:
        nodes = alive_nodes()
        # after a loss, aim for the scoring slots held before (the CPUs the old group frees are not yet counted)
        scorers = self.shape.scorers if shrink else default_scorers(
            self.cfg, self.max_decoders, ray.available_resources().get("CPU", 0.0))
        shape = plan_shape(self.cfg, self.device, self.max_decoders, scorers, list(nodes.values()), shrink)
        pg = placement_group(shape.bundles(), strategy="SPREAD", name=f"mbd-eval-{self.cfg.name}")
        print(f"mbd eval: reserving {shape.describe()} on {len(nodes)} node(s) (at most "
              f"{self.reserve_timeout_s:g}s)", file=sys.stderr, flush=True)
        try:
            ray.get(pg.ready(), timeout=self.reserve_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            free = ray.available_resources().get("CPU", 0.0)
            raise PlacementError(f"could not reserve {shape.describe()} within {self.reserve_timeout_s:g}s: "
                                 f"{free:g} of {ray.cluster_resources().get('CPU', 0):g} CPU are free, other "
                                 f"work holds the rest") from None
        self.pg, self.nodes = pg, set(nodes)
        strategy = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
        threads = self.cfg.engine.threads or (max(1, int(self.cfg.cpus_per_worker)) if self.device == "cpu" else None)
        engine = self.cfg.engine.model_copy(update={"device": self.device, "threads": threads,
                                                    "trace": self.cfg.trace_problems > 0})
        self.workers = [EvalWorker.options(num_cpus=self.cfg.cpus_per_worker, num_gpus=shape.decoder.get("GPU", 0),
                                           scheduling_strategy=strategy(i), max_restarts=0)
                        .remote(engine)
                        for i in range(shape.decoders)]
        placed = placement_group_table(pg).get("bundles_to_node_id", {})
        self.log({"event": "reserved", "shape": shape.describe(), "nodes_alive": len(nodes),
                  "decoder_nodes": [placed.get(i) for i in range(shape.decoders)],
                  "scorer_nodes": [placed.get(i) for i in range(shape.decoders, len(shape.bundles()))]})
        return shape

    def score_options(self, runtime_env: dict) -> dict:
        """Options of a scoring task: any free scoring slot of the reservation; never retried by Ray (a task lost
        with its node is resubmitted by the driver, so no lineage reconstruction waits on a lost slot)."""
        return {"num_cpus": self.cfg.cpus_per_scorer, "runtime_env": runtime_env, "max_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=-1)}

    def broken(self) -> bool:
        """Whether a bundle of the reservation is gone (its node died): work sent there would never be placed."""
        return self.pg is not None and placement_group_table(self.pg).get("state") != "CREATED"

    def rebuild(self, error: BaseException, lost: dict[str, int]) -> None:
        """After a lost worker or slot: wait (bounded) for the cluster to declare the dead node, then reserve again
        on the nodes left. The surviving actors go with the old group; the driver redoes all in-flight work."""
        deadline = time.monotonic() + NODE_DEATH_WAIT_S
        while time.monotonic() < deadline and not self.broken() and set(alive_nodes()) >= self.nodes:
            time.sleep(0.5)
        gone = sorted(self.nodes - set(alive_nodes()))
        self.close()
        print(f"mbd eval: lost {lost['problems']} decoding and {lost['scores']} scoring problems "
              f"({type(error).__name__}; nodes gone: {len(gone)}); reserving again on the nodes left", file=sys.stderr)
        self.log({"event": "lost", "error": type(error).__name__, "nodes_gone": gone, **lost})
        self.shape = self._reserve(shrink=True)

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def log(self, event: dict) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")


def read_placement_log(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / PLACEMENT_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
