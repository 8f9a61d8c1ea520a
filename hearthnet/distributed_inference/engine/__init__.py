"""The torch engine (M26 §5.7): model families, weight formats, KV caches, the layer
stack a shard runs, the head an orchestrator runs, sampling and the local engine.

This room knows nothing of the network: it imports nothing of `transport`, `mesh` or
`node` (checked by the import contract in `pyproject.toml`).
"""
