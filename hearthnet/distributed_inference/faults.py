"""Test-only fault injection for shards (issue 6 §5), enabled from a node's TOML.

```toml
[testing.faults]
mode = "nan"          # exit | nan | garbage | wrong_shape | slow | hang | close_mid_frame
after_steps = 5       # misbehave from the shard's 6th step on (default 0)
shard = "0-14"        # only the hosted shard with these layers (default: every shard)
delay_s = 1.0         # for "slow": seconds per step (one chunk per second)
```

Off by default: with no `[testing.faults]` nothing is installed, and the normal path only
checks one attribute (`ShardServer.step_hook is None`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from hearthnet.errors import ConfigError

MODES = ("exit", "nan", "garbage", "wrong_shape", "slow", "hang", "close_mid_frame")


class CloseMidFrame(Exception):
    """Raised from the hook; the shard writes half a frame and drops the connection."""


def install_faults(shard: Any, spec: dict[str, Any]) -> None:
    """Install the configured fault on `shard` (a `ShardServer`) if it matches."""
    if not spec:
        return
    mode = spec.get("mode")
    if mode not in MODES:
        raise ConfigError(f"testing.faults.mode must be one of {MODES}, not {mode!r}",
                          key="testing.faults.mode", reason="unknown mode")
    only = spec.get("shard")
    if only and only != f"{shard.lo}-{shard.hi}":
        return
    after = int(spec.get("after_steps", 0))
    delay = float(spec.get("delay_s", 1.0))
    count = {"n": 0}
    lock = threading.Lock()

    def hook(step: int, out: torch.Tensor) -> torch.Tensor:
        with lock:
            count["n"] += 1
            n = count["n"]
        if n <= after:
            return out
        if mode == "exit":
            os._exit(17)  # a crash: no goodbye, no withdrawal
        if mode == "nan":
            return out * float("nan")
        if mode == "garbage":
            return out * 1000.0
        if mode == "wrong_shape":  # plausible values, one hidden unit short (issue 14 §3)
            return out[..., :-1].contiguous()
        if mode == "slow":
            time.sleep(delay)
            return out
        if mode == "hang":
            threading.Event().wait()  # never answers
        raise CloseMidFrame()

    shard.step_hook = hook
