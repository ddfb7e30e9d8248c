"""Two-layout plans: op groups before a cut replicated on one device-group subset, the rest on another.

The classic case is Krizhevsky's "one weird trick": convolutions (much compute, few parameters) replicated
on every machine, the fully connected classifier (little compute, most parameters) on one machine, so that
activations cross the slow links instead of the classifier's gradients. A tree search that decides one op
group at a time reaches such a plan only through bad partial plans (a first action that spreads the whole
model, classifier included, over every machine), so the general search tries this family directly and
seeds its tree with the best member when that beats the data-parallel plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["layered_paths"]


def layered_paths(
    actions: Sequence[tuple[tuple[int, ...], str]],
    order: Sequence[int],
    dp_time: Callable[[int], float],
    width: int = 6,
    prefixes: int = 3,
) -> list[tuple[int, ...]]:
    """Search paths (action index per tree level) of the two-layout family.

    Args:
        actions: the search's actions as ``(device-group subset, option)``.
        order: op group decided at each tree level (the search's group order).
        dp_time: predicted iteration time of replicating the whole model with ``allreduce`` action ``i``
            (``inf`` when infeasible).
        width: suffix layouts among the ``width`` fastest data-parallel subsets, with ``allreduce`` or ``ps``.
        prefixes: prefix layouts among the ``prefixes`` fastest data-parallel subsets and the ``prefixes``
            largest subsets (the trick replicates the front on many devices, even where replicating the
            whole model there is slow), with ``allreduce`` or ``ps``: a front spread over many machines
            syncs its gradients cheaper through servers on each of them (vgg19 on paper-cloud: 208.7 ms
            with a ``ps`` front against 234.2 with an ``allreduce`` one, the classifier on one machine).

    Returns:
        One path per (prefix layout, different suffix layout, cut between op groups ``c - 1`` and ``c``):
        at most ``2 * prefixes * 2 * 2 * width * (groups - 1)`` paths.
    """
    replicate = [i for i, (_, option) in enumerate(actions) if option == "allreduce"]
    ranked = sorted(replicate, key=lambda i: (dp_time(i), i))
    ranked = [i for i in ranked if dp_time(i) < float("inf")]
    index = {a: i for i, a in enumerate(actions)}

    def with_ps(i: int) -> list[int]:
        """Replicated action ``i`` and its subset's ``ps`` action, when there is one."""
        ps = index.get((actions[i][0], "ps"))
        return [i] if ps is None else [i, ps]

    suffixes = [a for i in ranked[:width] for a in with_ps(i)]
    paths = []
    groups = len(order)
    widest = sorted(ranked, key=lambda i: (-len(actions[i][0]), dp_time(i), i))[:prefixes]
    firsts = [a for i in dict.fromkeys(ranked[:prefixes] + widest) for a in with_ps(i)]
    for first in firsts:
        for second in suffixes:
            if actions[second][0] == actions[first][0]:
                continue
            for cut in range(1, groups):
                paths.append(tuple(first if g < cut else second for g in order))
    return paths
