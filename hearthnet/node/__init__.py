"""The node daemon's composition root: `Node` (daemon.py), its security guard and status.

It sits above `mesh/` and `distributed_inference/`, which never import it.
"""
