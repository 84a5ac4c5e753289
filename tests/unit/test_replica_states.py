"""The replica's state machine is one table in code (actors/replica_supervisor.py TRANSITIONS): the module
docstring's table must say the same, every transition it names is a method of the supervisor, every state is
reachable, and a transition the table lacks is refused."""

import re

import pytest

from actors import replica_supervisor
from actors.replica_supervisor import TRANSITIONS, ReplicaSupervisor, State


def rendered() -> list[tuple[str, str, str, str]]:
    return [(", ".join(src), event, f"`{method}`", ", ".join(dst) or "(unchanged)")
            for src, event, method, dst in TRANSITIONS]


def documented() -> list[tuple[str, ...]]:
    rows = [line for line in replica_supervisor.__doc__.splitlines() if line.startswith("| ")]
    return [tuple(cell.strip() for cell in row.strip("|").split("|")) for row in rows[1:]]


def test_the_docstring_table_is_the_transition_table():
    assert documented() == rendered()


def test_every_transition_is_a_method_and_every_state_is_reached():
    for _, _, method, _ in TRANSITIONS:
        assert callable(getattr(ReplicaSupervisor, method))
    reached = {State.SERVING} | {s for *_, dst in TRANSITIONS for s in dst}
    assert reached == set(State)


def test_the_only_thread_that_changes_state_is_the_supervisor():
    """`state` is assigned in one place, `_move`, which checks the table; no other module assigns it."""
    import inspect

    assigns = re.compile(r"^\s*[\w.]+\.state\b[\w., ]*=(?!=)", re.M)  # also `self.state, self._error = ...`
    assert len(assigns.findall(inspect.getsource(replica_supervisor))) == 2  # __init__ and _move
    for mod in ("actors.engine_host", "actors.engine_link", "actors.streams", "serve_app.decoder_replica"):
        assert not assigns.search(inspect.getsource(__import__(mod, fromlist=["_"])))


def test_a_transition_the_table_lacks_is_refused():
    sup = ReplicaSupervisor.__new__(ReplicaSupervisor)
    sup.state = State.FAILED
    with pytest.raises(RuntimeError, match="no transition failed -> serving"):
        sup._move(State.SERVING, "_next_trial")
    sup.state = State.RESTARTING
    sup._move(State.SERVING, "_next_trial")
    assert sup.state == State.SERVING


def test_the_supervisor_is_one_readable_file_and_the_host_only_holds_it():
    """Every state and transition in one file a newcomer reads at once; the host composes the supervisor (no base
    class whose members a subclass reaches into)."""
    import inspect

    from actors.engine_host import EngineHost

    assert len(inspect.getsource(replica_supervisor).splitlines()) <= 250
    assert EngineHost.__mro__ == (EngineHost, object)
