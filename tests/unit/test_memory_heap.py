"""A host's freed activations go back to the OS (engine/memory.py; M26 §5.6: a host holds
its weights and caches, not the history of its steps).

The pattern is a prefill chunk's, run in child interpreters (glibc's allocator state is
per process), one with glibc's own policy and one with `HEARTHNET_LARGE_BLOCKS_MIB=1`
applied as a node applies it (`apply_large_blocks`): a large
block freed first (glibc then raises its mmap threshold past the blocks that follow),
then blocks of a few MiB, each followed by a smaller long-lived allocation that pins the
heap above it, all freed. A child prints the MiB of RSS still held after the frees, and
after `release_free_heap` (glibc `malloc_trim`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearthnet.distributed_inference.engine import memory
from hearthnet.errors import BadRequest, ConfigError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or memory._libc() is None,
    reason="glibc's allocator on Linux (/proc/self/status)")

BLOCKS, BLOCK_MIB, PIN_KIB = 12, 4, 200

_CHILD = f"""
import ctypes, json
from hearthnet.distributed_inference.engine import memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def rss_mib():
    return memory.rss_bytes()["rss"] / 2**20

def touched(n):
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    return p

applied = memory.apply_large_blocks()
libc.free(touched(30 << 20))  # mapped; freed, it raises glibc's own threshold to 30 MiB
before = rss_mib()
blocks = []
for _ in range({BLOCKS}):
    blocks.append(touched({BLOCK_MIB} << 20))
    touched({PIN_KIB} << 10)  # outlives the blocks: the heap cannot shrink past it
for p in blocks:
    libc.free(p)
kept = rss_mib() - before
memory.release_free_heap()
print(json.dumps({{"applied": applied, "kept": kept, "trimmed": rss_mib() - before}}))
"""


def _children(*modes: str) -> dict[str, dict[str, float]]:
    """One child per mode, run at once (each pays torch's import)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != memory.LARGE_BLOCKS_ENV}
    procs = {m: subprocess.Popen([sys.executable, "-c", _CHILD], cwd=root, text=True,
                                 env={**env, **({memory.LARGE_BLOCKS_ENV: "1"}
                                                if m == "bound" else {})},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for m in modes}
    out = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr[-2000:]
        out[m] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_large_freed_blocks_leave_the_rss_only_with_the_threshold_or_a_trim() -> None:
    got = _children("plain", "bound")
    plain, bound = got["plain"], got["bound"]
    blocks, pins = BLOCKS * BLOCK_MIB, BLOCKS * PIN_KIB / 1024  # MiB
    # glibc's own policy: the freed blocks stay resident in the heap, until a trim
    assert plain["applied"] is False
    assert plain["kept"] >= pins + 0.75 * blocks, got
    assert plain["trimmed"] <= pins + 0.1 * blocks, got
    # with large blocks mapped on their own, they are gone as soon as they are freed
    assert bound["applied"] is True
    assert bound["kept"] <= pins + 0.1 * blocks, got


@pytest.mark.parametrize("threshold", [0, -1, (32 << 20) + 1])
def test_a_threshold_outside_glibcs_range_is_refused(threshold: int) -> None:
    with pytest.raises(BadRequest, match="outside glibc's range"):
        memory.return_large_blocks(threshold)


@pytest.mark.parametrize(("value", "threshold"), [
    ("", None), ("off", None), (" OFF ", None), ("1", 1 << 20), ("32", 32 << 20)])
def test_the_setting_names_off_or_a_size_in_mib(value: str, threshold: int | None) -> None:
    assert memory.large_blocks_setting(value) == threshold


@pytest.mark.parametrize("value", ["0", "33", "-1", "1.5", "on", "4MiB"])
def test_a_bad_setting_is_one_config_error_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match=memory.LARGE_BLOCKS_ENV) as e:
        memory.large_blocks_setting(value)
    assert e.value.key == memory.LARGE_BLOCKS_ENV
