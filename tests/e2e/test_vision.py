"""Images on real vLLM: the engine's own vision tower vs the gateway's sidecar path, through one gateway.

Two engines of one tiny random Qwen2.5-VL (make_vl_model.py), each pinned to its own core: ``native`` runs
its ViT; ``embeds`` has none (``--enable-mm-embeds``, both mm limits 0) and is fed ``image_embeds`` by the
gateway, which starts the vision sidecar (sidecars/vision/) as a managed child. Each engine serves the shared
name ``tiny-vl`` plus an alias of its own (``tiny-vl-native`` / ``tiny-vl-embeds``), so a request picks its
path by model name, through the same gateway. Needs the VL venv (venv_vl.sh: the engines' and the sidecar's
Python).
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from config.settings import load_settings
from gateway.app import Gateway, create_app
from tools.procs import free_port

from .engines import (
    OFFLINE_ENV,
    EngineConfig,
    VllmEngine,
    parse_prometheus,
    stop_all,
    venv_ready,
    wait_all_healthy,
)
from .gateways import FAST_HEALTH
from .prompts import filler_text
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-vl"
SIDECAR_START_S = 180.0
LOGPROB_TOLERANCE = 0.05  # bf16 on both paths; measured <= 0.0076 (docs/vision.md)
IMAGES = {"a": (112, 84), "b": (56, 84), "c": (140, 112)}  # multiples of 28: patch 14 x merge 2


def vl_venv() -> Path:
    default = Path.home() / ".cache" / "warmroute" / "e2e-vl-venv"
    return Path(os.environ.get("WARMROUTE_E2E_VL_VENV", default))


class VlEngine(VllmEngine):
    """A ``VllmEngine`` serving ``tiny-vl`` and one alias (``--served-model-name`` takes several names)."""

    def __init__(self, config: EngineConfig, alias: str, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.alias = alias

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--served-model-name") + 1
        cmd[at : at + 1] = [MODEL, self.alias]
        return cmd


def png(width: int, height: int, seed: str) -> str:
    """A seeded random RGB PNG as a data: URI (no PIL in the gateway's venv)."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(width * 3)) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- fixtures: two engines, one gateway with a managed sidecar (module-scoped: started once) -----------------


@pytest.fixture(scope="module")
def vl_python() -> Path:
    venv = vl_venv()
    if not venv_ready(venv):
        message = f"VL engine venv not ready at {venv}: run `bash tests/e2e/venv_vl.sh`"
        if os.environ.get("WARMROUTE_E2E_REQUIRED", "") not in ("", "0", "false", "no"):
            pytest.fail(message + " [WARMROUTE_E2E_REQUIRED is set]", pytrace=False)
        pytest.skip(message)
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def vl_model(vl_python: Path) -> Path:
    import subprocess

    cmd = [str(vl_python), str(Path(__file__).with_name("make_vl_model.py"))]
    done = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vl_engines(
    vl_python: Path, vl_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VlEngine]]:
    logs = Path(os.environ.get("WARMROUTE_E2E_LOG_DIR") or tmp_path_factory.mktemp("vl-logs"))
    base = {"python": vl_python, "model_dir": vl_model, "served_model_name": MODEL, "reasoning_parser": None}
    native = EngineConfig(
        **base, max_model_len=4096, extra_args=("--limit-mm-per-prompt", '{"image":4,"video":0}')
    )
    embeds = EngineConfig(
        **base,
        max_model_len=4096,
        extra_args=("--enable-mm-embeds", "--limit-mm-per-prompt", '{"image":0,"video":0}'),
    )
    cores = sorted(os.sched_getaffinity(0))
    engines = {
        name: VlEngine(cfg, f"{MODEL}-{name}", name=name, port=free_port(), cpus=str(cores[i % len(cores)]),
                       log_path=logs / f"vl-{name}.log")
        for i, (name, cfg) in enumerate((("native", native), ("embeds", embeds)))
    }  # fmt: skip
    started = time.monotonic()
    try:
        for engine in engines.values():
            engine.start()
        wait_all_healthy(engines.values())
        print(f"\n[e2e] VL engines healthy in {time.monotonic() - started:.0f}s", file=sys.stderr)
        yield engines
    finally:
        stop_all(engines.values())


@pytest.fixture(scope="module")
def vl_gateway(
    vl_python: Path, vl_model: Path, vl_engines: dict[str, VlEngine]
) -> Iterator[tuple[str, Gateway]]:
    port = free_port()
    command = [str(vl_python), "-m", "sidecars.vision", "--checkpoint", str(vl_model),
               "--host", "127.0.0.1", "--port", str(port), "--threads", "1"]  # fmt: skip
    env = {**OFFLINE_ENV, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    backends = [
        {"id": name, "url": e.base_url, "models": [MODEL, e.alias], "dialect": "vllm", "vision": name}
        for name, e in vl_engines.items()
    ]
    settings = load_settings(
        None,
        backends=backends,
        sidecar={
            "url": f"http://127.0.0.1:{port}",
            "managed": {"command": command, "cwd": str(REPO), "env": env, "start_timeout_s": SIDECAR_START_S},
            "timeout_s": 60,
        },
        health=FAST_HEALTH,
        canary={"enabled": False},
    )
    app = create_app(settings)
    gw: Gateway = app.state.gateway
    with serve(app) as (url, _):
        deadline = time.monotonic() + SIDECAR_START_S
        while not (gw.sidecar is not None and gw.sidecar.available):
            assert time.monotonic() < deadline, f"sidecar not ready: {gw.sidecar and gw.sidecar.status()}"
            time.sleep(0.2)
        yield url, gw


# -- helpers -------------------------------------------------------------------------------------------------


def chat(url: str, model: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:2000]
    out: dict[str, Any] = resp.json()
    out["served_by"] = resp.headers["x-warmroute-backend"]
    return out


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def top_logprobs(answer: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Per generated token: (the token, its top-5 as token -> logprob)."""
    return [
        (pos["token"], {t["token"]: t["logprob"] for t in pos["top_logprobs"]})
        for pos in answer["choices"][0]["logprobs"]["content"]
    ]


def sidecar_counters(gw: Gateway) -> dict[str, float]:
    assert gw.settings.sidecar is not None
    m = parse_prometheus(httpx.get(gw.settings.sidecar.url + "/metrics", timeout=10).text)
    return {k: m.get(f"warmroute_vision_cache_{k}_total", 0.0) for k in ("hits", "misses")}


def chat_requests(engine: VllmEngine) -> float:
    """POSTs the engine's HTTP layer saw on /v1/chat/completions, whatever their status."""
    text = httpx.get(engine.base_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and 'handler="/v1/chat/completions"' in line
    )


# -- tests ---------------------------------------------------------------------------------------------------


def test_native_and_sidecar_paths_agree_on_prompt_tokens_and_top5_logprobs(
    vl_gateway: tuple[str, Gateway],
) -> None:
    url, _ = vl_gateway
    largest, compared = 0.0, 0
    for name, (w, h) in IMAGES.items():
        messages = [user(image(png(w, h, name)), {"type": "text", "text": "Describe the image."})]
        answers = {
            path: chat(url, f"{MODEL}-{path}", messages, logprobs=True, top_logprobs=5)
            for path in ("native", "embeds")
        }
        assert {path: a["served_by"] for path, a in answers.items()} == {
            "native": "native",
            "embeds": "embeds",
        }
        tokens = {path: a["usage"]["prompt_tokens"] for path, a in answers.items()}
        assert tokens["native"] == tokens["embeds"], tokens
        native, embeds = top_logprobs(answers["native"]), top_logprobs(answers["embeds"])
        for (tok_n, top_n), (tok_e, top_e) in zip(native, embeds, strict=False):
            common = top_n.keys() & top_e.keys()
            assert len(common) >= 4, (name, top_n, top_e)
            diff = max(abs(top_n[t] - top_e[t]) for t in common)
            largest, compared = max(largest, diff), compared + 1
            assert diff <= LOGPROB_TOLERANCE, (name, top_n, top_e)
            if tok_n != tok_e:
                break  # the continuations diverge from here: nothing more to compare
        print(f"\n[e2e] image {name} {w}x{h}: prompt tokens {tokens}", file=sys.stderr)
    print(f"[e2e] largest top-5 logprob difference over {compared} positions: {largest:.4f}", file=sys.stderr)


def test_a_follow_up_turn_hits_the_sidecar_cache_and_the_engine_prefix_cache(
    vl_gateway: tuple[str, Gateway], vl_engines: dict[str, VlEngine]
) -> None:
    url, gw = vl_gateway
    engine = vl_engines["embeds"]
    assert gw.encoder is not None
    first = [user(image(png(84, 84, "follow")), {"type": "text", "text": filler_text(400, "follow-up")})]
    side0, cache0, calls0 = sidecar_counters(gw), engine.prefix_cache(), gw.encoder.calls
    turn1 = chat(url, f"{MODEL}-embeds", first)
    side1, cache1, calls1 = sidecar_counters(gw), engine.prefix_cache(), gw.encoder.calls
    follow = [*first, {"role": "assistant", "content": turn1["choices"][0]["message"]["content"] or "?"},
              {"role": "user", "content": "And the colours?"}]  # fmt: skip
    turn2 = chat(url, f"{MODEL}-embeds", follow)
    side2, cache2, calls2 = sidecar_counters(gw), engine.prefix_cache(), gw.encoder.calls
    print(
        f"\n[e2e] sidecar cache hits/misses {side0} -> {side1} -> {side2}; engine prefix cache hits/queries "
        f"{cache0} -> {cache1} -> {cache2}; prompt tokens {turn1['usage']['prompt_tokens']} -> "
        f"{turn2['usage']['prompt_tokens']}",
        file=sys.stderr,
    )
    assert (calls1 - calls0, calls2 - calls1) == (1, 1)  # one encode per unique image per request
    assert (side1["misses"] - side0["misses"], side1["hits"] - side0["hits"]) == (1, 0)
    assert (side2["misses"] - side1["misses"], side2["hits"] - side1["hits"]) == (0, 1)
    turn1_hits = (cache1 - cache0).hits
    turn2_hits = (cache2 - cache1).hits
    # Turn 2 re-reads turn 1's prompt from the cache: the image's tokens and ~400 text tokens (whole blocks).
    assert turn2_hits >= 256 > turn1_hits, (turn1_hits, turn2_hits)


def test_a_1x3_grid_is_a_vllm_400_and_the_gateway_never_sends_one(
    vl_gateway: tuple[str, Gateway], vl_engines: dict[str, VlEngine]
) -> None:
    from tests.gateway.vision_fakes import GRID_1X3, FakeSidecar

    _, gw = vl_gateway
    engine = vl_engines["embeds"]
    assert gw.settings.sidecar is not None
    real = httpx.post(
        gw.settings.sidecar.url + "/v1/encode", json={"image": png(56, 84, "b")}, timeout=60
    ).json()
    wrong = {"image_embeds": real["image_embeds"], "image_grid_thw": GRID_1X3, "tokens": real["tokens"]}
    part = {"type": "image_embeds", "image_embeds": {k: wrong[k] for k in ("image_embeds", "image_grid_thw")}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    direct = httpx.post(engine.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 400 and "1-D tensor" in direct.text, direct.text[:500]  # the trap is real

    fake = FakeSidecar(answers={"data:image/png;base64,AAAA": (200, wrong)})
    with contextlib.ExitStack() as stack:
        sidecar_url, _ = stack.enter_context(serve(fake.app()))
        backends = [
            {"id": "embeds", "url": engine.base_url, "models": [MODEL], "dialect": "vllm", "vision": "embeds"}
        ]
        app = create_app(
            load_settings(None, backends=backends, sidecar={"url": sidecar_url}, canary={"enabled": False})
        )
        url, _ = stack.enter_context(serve(app))
        before = chat_requests(engine)
        assert before >= 1  # the counter is there: it saw the direct request above
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        resp = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": [image]}], "max_tokens": 1},
            timeout=60,
        )
        assert resp.status_code == 502
        assert "image_grid_thw of shape [1, 3]; engines need shape [3]" in resp.json()["error"]["message"]
        assert chat_requests(engine) == before
