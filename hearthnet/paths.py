"""Where HearthNet keeps its data: `HEARTHNET_DATA_DIR`, else ~/.local/share/hearthnet."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The data directory (created if missing).

    Args:
        override: an explicit directory (e.g. from a node's config); wins over the
            environment.
    """
    if override:
        p = Path(override).expanduser()
    elif os.environ.get("HEARTHNET_DATA_DIR"):
        p = Path(os.environ["HEARTHNET_DATA_DIR"]).expanduser()
    else:
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        p = Path(base) / "hearthnet"
    p.mkdir(parents=True, exist_ok=True)
    return p


def models_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The model store folder inside the data directory."""
    p = data_dir(override) / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p
