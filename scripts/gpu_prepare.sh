#!/usr/bin/env bash
# Prepares what a GPU machine without network needs to run HearthNet's GPU checks
# (scripts/gpu_checks.sh): the packages its image lacks, as cp312 wheels at this checkout's
# .venv versions, in .whl/; SmolLM2's tokenizer files (for the tests' tiny models and the
# synthetic models) in .gpu/tok/, from the store of HEARTHNET_DATA_DIR. Both folders are
# ignored by git and travel as carried paths (device tool: carry [".whl", ".gpu"]).
#
#   scripts/gpu_prepare.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# what the device image (torch 2.11, transformers, msgpack, uvloop, prometheus-client,
# aiohttp, numpy, safetensors, ...) lacks among the project's dependencies
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions
websockets structlog gguf cryptography cffi pycparser zeroconf ifaddr spake2 pytest-asyncio"
mkdir -p .whl .gpu/tok
for name in $PACKAGES; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$version" ] || { echo "not installed in $PY's environment: $name" >&2; exit 1; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$version" 2>&1 | grep -v '^WARNING' || true
done
tok=$("$PY" -c "from hearthnet.models import ModelStore; e = ModelStore().find('smollm2'); print(e.path if e else '')")
[ -n "$tok" ] || { echo "no smollm2 in the store of HEARTHNET_DATA_DIR: run make install" >&2; exit 1; }
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$tok/$f" ] && cp "$tok/$f" .gpu/tok/
done
du -sh .whl .gpu
