"""Where the CLI and host apps reach their own node: its loopback admin listener.

Torch-free and CLI-free: `hearthnet.client.HearthNetClient.from_config` and the CLI's
commands both call `node_uri`.
"""

from __future__ import annotations

from hearthnet.config import load_config
from hearthnet.errors import ConnectionLost
from hearthnet.node.guard import STATE_FILE, read_state


def node_uri(config_path: str) -> str:
    """Where the CLI reaches its own node: the loopback admin listener.

    The running node writes its admin URI to ``<data_dir>/node.json``; the main listener
    is mutual TLS for members only, so the CLI does not use it. A node configured with
    ``insecure_plaintext = true`` and no admin listener is reached on its main port.
    """
    cfg = load_config(config_path)
    data = cfg.effective_data_dir()
    state = read_state(data)
    if state and isinstance(state.get("admin"), str) and state["admin"]:
        return str(state["admin"])
    if cfg.security.insecure_plaintext:
        return f"ws://{cfg.advertise_host()}:{cfg.node.listen_port}"
    raise ConnectionLost(f"node {cfg.node.id} is not running (no admin address in "
                         f"{data / STATE_FILE}); start it with `hearthnet node --config "
                         f"{config_path}`")
