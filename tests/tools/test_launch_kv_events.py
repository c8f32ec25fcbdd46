"""Benchmarks with KV cache events: launched simulators publish them and the launched gateway subscribes."""

from __future__ import annotations

import time

import httpx

from tools.launch import Launcher, SimProfile

MODEL = "sim-model"


def test_sims_publish_kv_events_and_the_gateway_reads_them() -> None:
    with Launcher() as launch:
        engines = launch.start_sims(1, SimProfile(time_scale=0.0, kv_events=True), MODEL)
        assert engines[0].kv_endpoint is not None and engines[0].kv_endpoint.startswith("tcp://127.0.0.1:")
        gateway = launch.start_gateway(engines, MODEL, "ttft")
        line = 'warmroute_kv_events_total{backend="engine-1",type="BlockStored"}'
        deadline = time.monotonic() + 30
        for n in range(1000):  # the subscription may not be live for the first request: ask until it is
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{n} " + "word " * 64}]}
            assert httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
            if line in httpx.get(gateway.url + "/metrics", timeout=10).text:
                break
            assert time.monotonic() < deadline, "no KV events reached the gateway"
