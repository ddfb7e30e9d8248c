"""The simulator's list scheduler in the C++ core (csrc/sim), on task graphs scheduled by hand."""

import pytest

from tagps import _core


def schedule(
    tasks: list[tuple[float, tuple[int, ...], list[int]]],
    nres: int,
    steps: int = 1,
    waits: list[tuple[int, int]] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """``tasks``: (duration, resources, predecessors) per task of one step."""
    preds = [p for _, _, deps in tasks for p in deps]
    return _core.list_schedule(
        [d for d, _, _ in tasks], [r for _, r, _ in tasks], [len(deps) for _, _, deps in tasks], preds,
        steps, waits or [], nres,
    )  # fmt: skip


def test_tasks_ready_together_take_a_resource_in_creation_order() -> None:
    start, finish, busy = schedule([(1.0, (0,), []), (2.0, (0,), [])], nres=1)
    assert (start, finish, busy) == ([0.0, 1.0], [1.0, 3.0], [3.0])


def test_a_resource_serves_the_task_ready_first_not_the_one_created_first() -> None:
    tasks = [
        (2.0, (1,), []),
        (1.0, (2,), []),
        (5.0, (0,), [0]),  # ready at 2
        (3.0, (0,), [1]),  # ready at 1: runs first, so task 2 waits until 4
    ]
    start, finish, busy = schedule(tasks, nres=3)
    assert start == [0.0, 0.0, 4.0, 1.0]
    assert finish == [2.0, 1.0, 9.0, 4.0]
    assert busy == [8.0, 2.0, 1.0]


def test_events_at_the_same_time_release_in_task_order() -> None:
    tasks = [
        (1.0, (1,), []),
        (1.0, (2,), []),
        (1.0, (0,), [1]),  # released by task 1, after task 3:
        (1.0, (0,), [0]),  # both finish at 1, and task 0 leaves the heap first
    ]
    start, _, _ = schedule(tasks, nres=3)
    assert start[3] == 1.0 and start[2] == 2.0


def test_a_task_on_several_resources_waits_for_all_and_occupies_all() -> None:
    tasks = [(3.0, (0,), []), (1.0, (1,), []), (1.0, (0, 1), []), (1.0, (1,), [])]
    start, _, busy = schedule(tasks, nres=2)
    assert start == [0.0, 0.0, 3.0, 4.0]  # task 3 is ready at 0 but queues behind task 2 on resource 1
    assert busy == [4.0, 3.0]


def test_a_task_with_no_resource_only_waits_for_its_predecessors() -> None:
    start, finish, busy = schedule([(2.0, (0,), []), (0.0, (), [0]), (1.0, (0,), [1])], nres=1)
    assert start == [0.0, 2.0, 2.0] and finish == [2.0, 2.0, 3.0] and busy == [3.0]


def test_steps_repeat_the_tasks_and_waits_chain_them() -> None:
    tasks = [(1.0, (0,), []), (2.0, (1,), [0])]
    start, finish, busy = schedule(tasks, nres=2, steps=3, waits=[(0, 1)])
    assert start == [0.0, 1.0, 3.0, 4.0, 6.0, 7.0]
    assert finish == [1.0, 3.0, 4.0, 6.0, 7.0, 9.0]
    assert busy == [3.0, 6.0]
    # Without the wait, step 2's first task starts as soon as its resource is free.
    start, _, _ = schedule(tasks, nres=2, steps=2)
    assert start == [0.0, 1.0, 1.0, 3.0]


@pytest.mark.parametrize(
    ("tasks", "nres", "waits", "message"),
    [
        ([(1.0, (0,), [0])], 1, [], "not an earlier task"),
        ([(1.0, (0,), []), (1.0, (0,), [2])], 1, [], "not an earlier task"),
        ([(1.0, (1,), [])], 1, [], "resource 1 out of range"),
        ([(1.0, (-1,), [])], 1, [], "out of range"),
        ([(1.0, (0,), [])], 1, [(0, 1)], "out of range"),
    ],
)
def test_malformed_tasks_are_refused(
    tasks: list[tuple[float, tuple[int, ...], list[int]]],
    nres: int,
    waits: list[tuple[int, int]],
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        schedule(tasks, nres=nres, steps=2, waits=waits)


def test_inconsistent_lists_and_wrong_types_are_refused() -> None:
    with pytest.raises(ValueError, match="one item per task"):
        _core.list_schedule([1.0, 1.0], [(0,)], [0, 0], [], 1, [], 1)
    with pytest.raises(ValueError, match="sum\\(pred_counts\\)"):
        _core.list_schedule([1.0], [(0,)], [0], [0], 1, [], 1)
    with pytest.raises(TypeError, match="resources must be tuples"):
        _core.list_schedule([1.0], [[0]], [0], [], 1, [], 1)
    with pytest.raises(TypeError):
        _core.list_schedule(["1"], [(0,)], [0], [], 1, [], 1)
    with pytest.raises(ValueError, match="steps"):
        _core.list_schedule([1.0], [(0,)], [0], [], 0, [], 1)
