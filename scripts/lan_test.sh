#!/usr/bin/env bash
# Real-host test of HearthNet failover (M26 §5.4, §8.2): four nodes in four network namespaces on
# one bridge (10.231.0.0/24), each with its own address; a happy-path chat, a whole host
# killed mid-answer and a link cut mid-answer (veth down) must all finish with the exact
# answer. The namespaces, veths, bridge and processes are removed at the end.
#
#   sudo scripts/lan_test.sh             run tests/netns (pytest marker `netns`)
#   sudo scripts/lan_test.sh -k link     extra pytest arguments pass through
#   sudo scripts/lan_test.sh --cleanup   remove what an interrupted run left behind
#
# Needs root and iproute2 (`ip netns`); uses .venv and the model store of
# HEARTHNET_DATA_DIR (`make install` imports the model).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

stale() {  # $1 = a name hnl<pid>...: true when process <pid> (its test run) is gone
    local owner=${1#hnl}
    owner=${owner%%[!0-9]*}
    ! kill -0 "$owner" 2>/dev/null
}

cleanup_leftovers() {
    # every name the harness makes starts with hnl<pid> (tests/netns/conftest.py); only
    # those of test runs that are no longer alive are removed
    local ns link pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^hnl[0-9]+-' || true); do
        stale "$ns" || continue
        for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
            kill -9 "$pid" 2>/dev/null || true
        done
        ip netns del "$ns" 2>/dev/null || true
        echo "removed namespace $ns"
    done
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
                  | grep -E '^hnl[0-9]+(br|v[0-9]+)$' || true); do
        stale "$link" || continue
        ip link del "$link" 2>/dev/null || true
        echo "removed link $link"
    done
}

if [[ "${1:-}" == "--cleanup" ]]; then
    cleanup_leftovers
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "lan_test.sh: network namespaces need root; run with sudo" >&2
    exit 2
fi
if ! command -v ip >/dev/null; then
    echo "lan_test.sh: the ip command (iproute2) is missing" >&2
    exit 2
fi
if [[ ! -x "$PY" ]]; then
    echo "lan_test.sh: $PY not found; run 'make install' first" >&2
    exit 2
fi

trap cleanup_leftovers EXIT  # the fixture cleans up; this catches a killed pytest
"$PY" -m pytest -m netns tests/netns -v -s -rs -p no:cacheprovider "$@"
