"""The local model store: import (GGUF or Hugging Face folder), manifest, weights hash.

Knows nothing of the network (STYLE.md). See `store.py` for the folder layout and the
definition of `weights_sha256`.
"""

from hearthnet.models.store import ModelEntry, ModelStore

__all__ = ["ModelEntry", "ModelStore"]
