"""The float dtypes a tensor may be held or sent in, by the names the config, the wire
and the store use (`constants.WIRE_DTYPES`, same order).

One table on the ground floor: the model store (import's `--dtype`), the engine (float
weight formats) and the transport (wire dtypes) all name the same three dtypes, and none
of them may import another's module for it.
"""

from __future__ import annotations

import torch

from hearthnet.constants import WIRE_DTYPES

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16,
                                        "fp32": torch.float32}
"""The torch dtype of each float dtype name, in `constants.WIRE_DTYPES` order."""

assert tuple(FLOAT_DTYPES) == WIRE_DTYPES, "the wire names and this table must agree"
