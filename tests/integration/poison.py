"""A request that crashes the engine by itself, as a rare engine bug would, for the quarantine tests; the product
has no hook for it. A test sets `POISON_ENV` (token ids, comma-separated) and puts `SITE` on the import path of
the process that starts engine processes (actors/launch.py hands its sys.path on as PYTHONPATH): Python
then imports SITE's sitecustomize at each engine process's start, which wraps `Lockstep` so that a step with a
prompt holding the poison raises, in the engine process only (the process given `actors.messages.FD_ENV`).
`STEP_ENV` = N: a poisonous request crashes the engine on its N-th forward (its NFE, which a request resumed on a new
engine process carries on: the crash recurs at the same state, as a real one would); `PAIR_ENV` = 1: it crashes
only beside another request (alone it runs clean)."""

from __future__ import annotations

import os
from pathlib import Path

POISON_ENV = "MBD_TEST_POISON"
STEP_ENV = "MBD_TEST_POISON_STEP"
PAIR_ENV = "MBD_TEST_POISON_PAIR"
SITE = str(Path(__file__).parent / "poison_site")
POISON = "7777"  # the text whose tokens a test hands over in POISON_ENV
INNOCENT = [f"{a}+{b}=" for a, b in ((1, 2), (12, 7), (3, 4), (25, 9), (6, 6), (41, 3), (8, 13), (70, 5))]


def holds(prompt_ids: list[int], poison: list[int]) -> bool:
    n = len(poison)
    return n > 0 and any(prompt_ids[i: i + n] == poison for i in range(len(prompt_ids) - n + 1))


def install() -> None:
    """Wrap Lockstep: admitted poisonous requests are remembered; a step that may run one raises (after the
    engine process sent its `Running`, as an exception in the model's forward would)."""
    from actors.messages import Add
    from actors.tp_worker import Lockstep

    poison = [int(t) for t in os.environ[POISON_ENV].split(",") if t]
    nth, pair = int(os.environ.get(STEP_ENV, "1")), os.environ.get(PAIR_ENV) == "1"
    apply, step = Lockstep.apply, Lockstep.step
    poisoned: set[str] = set()

    def apply_noting_poison(self: Lockstep, ops: list) -> list:
        refused = apply(self, ops)
        no = {r.request_id for r in refused}
        poisoned.update(op.request_id for op in ops if isinstance(op, Add) and op.request_id not in no
                        and holds(op.prompt_ids, poison))
        return refused

    def step_unless_poisoned(self: Lockstep) -> list:
        step_ids = self.in_step()
        sched = self.engine.scheduler
        nfe = {r.id: r.nfe for r in [*sched.running.values(), *sched.waiting]}
        # the step about to run is a request's (nfe + 1)-th forward, counted across engines (a resumed request
        # goes on from its checkpoint's NFE): the crash comes back at the same state when the request is replayed
        if any(rid in poisoned and nfe.get(rid, 0) + 1 >= nth for rid in step_ids) and (not pair or len(step_ids) >= 2):
            raise RuntimeError(f"{POISON_ENV}: a poisonous request is in the step")
        return step(self)

    Lockstep.apply, Lockstep.step = apply_noting_poison, step_unless_poisoned
