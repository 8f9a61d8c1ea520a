"""The CLI's command groups: each module exposes `register(subparsers)` (see `cli.py`).

Nothing below the CLI imports this package (the import contracts in `pyproject.toml`).
"""
