"""LoopState, the loop's view of a run, against the run's own TrainState: the loop names only the
protocol, so nothing else notices when the two drift apart (no type checker runs here)."""

from __future__ import annotations

import inspect

from trainer.loop.state import LoopState, Position
from trainer.run import Progress, TrainState


def test_should_find_each_loop_state_member_on_train_state_when_compared_by_name_and_type():
    theirs = inspect.get_annotations(TrainState)
    for name, annotation in inspect.get_annotations(LoopState).items():
        assert theirs.get(name) == annotation, f"TrainState.{name}: {theirs.get(name)!r}, LoopState says {annotation!r}"

    properties = [name for name, value in vars(LoopState).items() if isinstance(value, property)]
    assert properties == ["progress"] and theirs["progress"] == "Progress"
    position, progress = inspect.get_annotations(Position), inspect.get_annotations(Progress)
    assert {name: progress.get(name) for name in position} == position

    hooks = [name for name, value in vars(LoopState).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert hooks == ["preemption_point", "after_step"]
    for name in hooks:
        assert inspect.signature(getattr(TrainState, name)) == inspect.signature(getattr(LoopState, name)), name
