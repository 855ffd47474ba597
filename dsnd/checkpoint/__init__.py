"""dsnd's own checkpoints: per-layer, layout-free, atomically committed, verified on load.

layout.py (paths, manifest, verification; pure) -> commit.py (atomic writes and commit) ->
rng.py, state.py (what a rank saves and restores) -> save.py, load.py (the collective steps).
"""
