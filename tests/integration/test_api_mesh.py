"""Issue 15 against a live three-process mesh: the `openai` package, the host-app client and
a real headless chromium on the status page.

One mesh for the module (node-a orchestrates, node-b hosts layers 0–14, node-c 15–29). The
browser test kills node-c, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hearthnet.client import Done, HearthNetClient, ShardStatus, TokenDelta
from hearthnet.distributed_inference.engine.generation import Generation
from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import BadRequest
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from tests.helpers.browser import Browser, chromium_path
from tests.unit.test_tools import WEATHER

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"
N = 24
TEXT_PROMPT = "The capital of France is"  # a raw prompt: continued, not answered
TEXT_N = 8
GAUGE = "hearthnet_distributed_inference_shard_active_sessions"


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory):
    with LocalMesh([NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]),
                    NodeSpec("node-c", [(15, 29)])],
                   root=tmp_path_factory.mktemp("mesh")) as m:
        yield m


@pytest.fixture(scope="module")
def reference(mesh) -> str:
    """`hearthnet chat` through node-a, greedy: the text every other client must match."""
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "chat", PROMPT, "--config",
                        str(mesh.nodes["node-a"].config), "--max-tokens", str(N), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert frames[-1]["type"] == "done"
    return "".join(f["text"] for f in frames if f["type"] == "token_delta")


@pytest.fixture(scope="module")
def text_reference(smollm2) -> tuple[str, int]:
    """The local engine's greedy continuation of `TEXT_PROMPT` as the tokenizer gives it —
    no chat template — and the prompt's length in tokens."""
    engine = LocalEngine(smollm2)
    tok = engine.head.tokenizer
    ids = list(tok(TEXT_PROMPT)["input_ids"])
    gen = Generation(tok, ids, SamplingParams(max_tokens=TEXT_N), engine.head.eos_token_ids)
    return "".join(ev.text for ev in engine.run(gen)), len(ids)


@pytest.fixture
async def oai(mesh):
    async with openai.AsyncOpenAI(base_url=mesh.nodes["node-a"].api + "/v1", api_key="local",
                                  max_retries=0, timeout=300) as c:
        yield c


def _sessions(mesh: LocalMesh, node_id: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(mesh.metrics(node_id))
               for s in fam.samples if s.name == GAUGE)


async def test_openai_answers_equal_hearthnet_chat(oai, reference):
    msgs = [{"role": "user", "content": PROMPT}]
    r = await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=N,
                                          temperature=0)
    assert r.choices[0].message.content == reference
    assert r.usage.completion_tokens == N or r.choices[0].finish_reason == "stop"
    assert len(r.model_extra["hearthnet"]["pipeline"]) == 2
    # the formats that served it, lossless by default (weights and wire)
    f = r.model_extra["hearthnet"]["formats"]
    assert f["lossless"] is True and f["policy"] == "lossless" and f["wire"] == ["fp32"] * 2
    stream = await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=N,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


async def test_openai_client_model_objects_and_refused_fields(oai, reference):
    """`models.retrieve` gives the listed object, an unknown model is a NotFoundError, a
    field the mesh does not honour is a 400 naming it, and its "off" value is the plain
    call (DESIGN.md decision 13)."""
    listed = next(m for m in (await oai.models.list()).data if m.id == "smollm2")
    got = await oai.models.retrieve("smollm2")
    assert (got.id, got.object, got.owned_by) == (listed.id, listed.object, listed.owned_by)
    assert got.model_extra["hearthnet"]["model_id"] == listed.model_extra["hearthnet"]["model_id"]
    assert got.model_extra["hearthnet"]["num_layers"] == 30
    with pytest.raises(openai.NotFoundError) as e:
        await oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    msgs = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's bound: 20
        await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=N,
                                          logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=N,
                                          frequency_penalty=0.5)
    assert e.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as e:  # SmolLM2's template has no tools
        await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=N,
                                          tools=[WEATHER])
    # the node's refusal crosses the bus as code and message (ErrorFrame.of keeps no param)
    assert e.value.body["code"] == "bad_request"
    assert "tools are not supported" in e.value.body["message"]
    assert "chat template does not support tools" in e.value.body["message"]
    r = await oai.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=N, temperature=0, logprobs=False,
        frequency_penalty=0, presence_penalty=0, response_format={"type": "text"}, n=1,
        tool_choice="none")
    assert r.choices[0].message.content == reference
    assert r.choices[0].finish_reason in ("stop", "length")


async def test_openai_completions_continue_the_raw_prompt(oai, text_reference):
    """``/v1/completions`` through the mesh: the raw prompt's greedy continuation, without
    the chat template (the prompt is counted as its own tokens only)."""
    want, prompt_tokens = text_reference
    r = await oai.completions.create(model="smollm2", prompt=TEXT_PROMPT, max_tokens=TEXT_N,
                                     temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.prompt_tokens == prompt_tokens
    assert len(r.model_extra["hearthnet"]["pipeline"]) == 2  # served by the mesh
    stream = await oai.completions.create(model="smollm2", prompt=[TEXT_PROMPT],
                                          max_tokens=TEXT_N, temperature=0, stream=True,
                                          logprobs=2)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == r.usage.completion_tokens
    assert "".join(tokens).startswith(want)  # want may end in a held-back stop


async def test_openai_chat_logprobs_are_the_model_s(oai, reference):
    """``logprobs`` / ``top_logprobs`` through the mesh (speculation on, as by default):
    one entry per token, log-probabilities, alternatives likeliest first, the greedy token
    the likeliest; the answer is the one without them."""
    r = await oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPT}], max_tokens=TEXT_N,
        temperature=0, logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert reference.startswith(text) and text
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert c.logprob <= 0 and len(tops) == 2 and tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)
    assert bytes(b for c in content for b in c.bytes).decode().startswith(text)


CAPITAL = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
    "capital": {"type": "boolean"}}, "required": ["city", "capital"],
    "additionalProperties": False}


async def test_openai_response_format_is_enforced_through_the_mesh(oai):
    """M26 §5.4: ``json_schema`` answers validate (checked by hand: keys and types),
    ``json_object`` answers parse — served by the mesh, the head masking at node-a."""
    msgs = [{"role": "user", "content": "Is Paris the capital of France? Answer in JSON."}]
    r = await oai.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=32, temperature=0, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {
            "name": "capital", "schema": CAPITAL, "strict": True}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"city", "capital"} and r.choices[0].finish_reason == "stop"
    assert out["city"] in ("Paris", "Lyon", "Marseille") and isinstance(out["capital"], bool)
    # log-probabilities stay the model's raw ones, one per token (a forced token's too)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens and all(c.logprob <= 0 for c in lps)
    assert len(r.model_extra["hearthnet"]["pipeline"]) == 2  # the mesh served it
    stream = await oai.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=48, temperature=0, stream=True,
        response_format={"type": "json_object"})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: an object begun, as OpenAI's json mode leaves it
        assert chunks[-1].choices[0].finish_reason == "length"
        assert text.lstrip().startswith("{")


async def test_disconnect_mid_stream_closes_shard_sessions(mesh, oai):
    stream = await oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=2000, temperature=0, stream=True)
    got = 0
    async for c in stream:
        got += bool(c.choices and c.choices[0].delta.content)
        if got == 3:
            break
    assert _sessions(mesh, "node-b") == 1 and _sessions(mesh, "node-c") == 1
    await stream.close()  # the host app goes away ~1990 tokens early
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_sessions(mesh, "node-b") or
                                           _sessions(mesh, "node-c")):
        await asyncio.sleep(0.2)
    assert _sessions(mesh, "node-b") == 0 and _sessions(mesh, "node-c") == 0


async def test_host_app_client_typed_frames_and_errors(mesh, reference):
    async with HearthNetClient.from_config(mesh.nodes["node-a"].config) as hn:  # docs/api.md's way
        frames = [f async for f in hn.chat(PROMPT, max_tokens=N)]
        assert all(isinstance(f, ShardStatus) for f in frames[:2])
        assert "".join(f.text for f in frames if isinstance(f, TokenDelta)) == reference
        assert isinstance(frames[-1], Done) and len(frames[-1].pipeline) == 2
        with pytest.raises(BadRequest, match="max_tokens"):
            async for _ in hn.chat(PROMPT, max_tokens=0):
                pass
        with pytest.raises(BadRequest):  # unknown model: the spec's bad_request
            await hn.answer(PROMPT, model="no-such-model")


def _readme_blocks(repo_root: Path) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of docs/api.md's HTTP API section."""
    text = (Path(repo_root) / "docs" / "api.md").read_text()
    section = text.split("## HTTP API, host apps and the status page", 1)[1].split("\n## ")[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_readme_examples_run_against_a_mesh(mesh, repo_root):
    """docs/api.md's curl call, openai-client call and host-app client example, as printed
    there, with the example's address and config swapped for this mesh's."""
    a = mesh.nodes["node-a"]
    blocks = _readme_blocks(repo_root)
    runs = {"sh": ["bash", "-c"], "python": [sys.executable, "-c"]}
    outputs = []
    for lang, code in blocks:
        if lang not in runs:
            continue
        code = code.replace("http://127.0.0.1:8080", a.api).replace(
            "config/mesh3/node-a.toml", str(a.config))
        if lang == "sh" and shutil.which("curl") is None:
            outputs.append(None)  # no curl on this machine: the Python examples still run
            continue
        r = subprocess.run([*runs[lang], code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (code, r.stderr[-2000:])
        outputs.append(r.stdout)
    assert len(outputs) == 3  # curl, openai, HearthNetClient
    if outputs[0] is not None:
        assert "Paris" in json.loads(outputs[0])["choices"][0]["message"]["content"]
    assert outputs[1].strip() and "Paris" in outputs[2]


def test_node_logs_are_one_format_with_load_progress(mesh):
    """Every stderr line of every node is a structlog JSON line (websockets' and aiohttp's
    own loggers included), and loading a shard says so."""
    for node_id in mesh.nodes:
        text = mesh.log_text(node_id)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert lines and all(ln.startswith("{") for ln in lines), \
            [ln for ln in lines if not ln.startswith("{")][:3]
        events = [json.loads(ln)["event"] for ln in lines]
        assert "connection open" not in events
    b = [json.loads(ln) for ln in mesh.log_text("node-b").splitlines() if ln.strip()]
    started = next(e for e in b if e["event"] == "shard_load_started")
    done = next(e for e in b if e["event"] == "shard_load_done")
    assert started["layers"] == done["layers"] == [0, 14] and done["seconds"] > 0


def test_one_error_format_for_local_and_remote_chat(mesh):
    """The same mistake reads the same from `chat --local` and through a node."""
    base = [sys.executable, "-m", "hearthnet.cli", "chat", "hi", "--model", "no-such-model"]
    local = subprocess.run([*base, "--local"], capture_output=True, text=True, timeout=300)
    remote = subprocess.run([*base, "--config", str(mesh.nodes["node-a"].config)],
                            capture_output=True, text=True, timeout=300)
    assert local.returncode == remote.returncode == 1
    lines = [r.stderr.strip().splitlines()[-1] for r in (local, remote)]
    assert lines[0] == lines[1] and lines[0].startswith("hearthnet: bad_request: "), lines


@pytest.mark.skipif(chromium_path() is None,
                    reason="Debian's chromium is not installed (`apt-get install chromium`; "
                           "`make test` installs it where apt is usable)")
def test_status_page_in_headless_chromium(mesh, repo_root, tmp_path):
    out = Path(repo_root) / "bench-results"
    model = "document.querySelector('.model[data-model=smollm2]')"
    lanes = ("Array.from(document.querySelectorAll('.model[data-model=smollm2] .lane'))"
             ".map(l => l.dataset.host + ':' + l.dataset.state).sort().join(',')")
    with Browser(tmp_path / "profile") as b:
        b.viewport(412, 915, mobile=True)  # a phone
        b.goto(mesh.nodes["node-a"].api + "/")
        b.wait_for(f"{model} && {model}.dataset.covered === 'true'")
        assert b.eval(lanes) == "node-b:online,node-c:online"
        assert b.eval("document.querySelectorAll('.coverage .seg.gap').length") == 0
        assert b.eval("document.querySelectorAll('#shards .shard-row').length") == 2
        b.eval("document.getElementById('prompt').value = 'Say hello.'; "
               "document.getElementById('send').click(); true")
        b.wait_for("document.getElementById('answer').dataset.state === 'done'", 180)
        assert b.eval("document.getElementById('answer').textContent.trim().length") > 0
        facts = b.eval("document.getElementById('answer-facts').textContent")
        assert "node-b" in facts and "wire fp32 · lossless" in facts, facts
        b.screenshot(out / "status-page.png")
        b.viewport(1000, 700)
        b.screenshot(out / "status-page-desktop.png")
        b.viewport(412, 915, mobile=True)
        mesh.kill("node-c")  # a host dies: the page must say so without a reload
        b.wait_for(f"{lanes}.includes('node-c:offline')", 60)
        assert b.eval(f"{model}.dataset.covered") == "false"
        assert b.eval("document.querySelectorAll('.coverage .seg.gap').length") == 1
        reason = b.eval("document.querySelector('.shard-row[data-state=offline] .reason')"
                        ".textContent")
        assert "node-c" in reason and "lost" in reason
        b.screenshot(out / "status-page-degraded.png")


async def test_dead_host_without_fallback_is_503_and_listed_on_the_status(mesh, oai,
                                                                         text_reference):
    """A shard host is gone (killed above, or here): no cover and no fallback → 503; with
    the fallback a text completion goes on locally, its prompt still raw."""
    mesh.kill("node-c")
    msgs = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.InternalServerError) as e:
        await oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                          extra_body={"hearthnet": {"fallback_to_local":
                                                                    False}})
    assert e.value.status_code == 503 and e.value.body["code"] == "shard_unavailable"
    st = mesh.status("node-a")
    assert any(ev["type"] == "pipeline_aborted" for ev in st["recent_events"])
    r = await oai.completions.create(model="smollm2", prompt=TEXT_PROMPT, max_tokens=TEXT_N,
                                     temperature=0)
    assert r.model_extra["hearthnet"]["fallback"] is True
    assert r.choices[0].text == text_reference[0]
