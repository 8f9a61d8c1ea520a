"""Who hosts what (M26 §4, §5.1–§5.2): shard descriptors, weight formats, the store of
advertisements folded from the event log, health, liveness and routing.

This room imports no torch: a node that only answers `status` or routes a call never
loads the model runtime (the import contract in `pyproject.toml` checks it).
"""
