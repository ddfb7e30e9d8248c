"""TAG, the strategy creator: graph, topology, grouping, plan (the strategy IR), simulator, baselines.

Submodules are imported on demand (``from tagps.strategy import plan``); heavy optional dependencies
(pymetis, cvxpy, torch_geometric) are imported inside the functions that need them. Nothing here imports
the runtime (``tagps.ps``, ``tagps.torch``, ``tagps.comm``).
"""

__all__: list[str] = []
