"""Reading an engine's Prometheus ``/metrics``: the few vLLM series the gateway's tools use.

vLLM (V1) exposes the prefix-cache counters ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (both in tokens) and the gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, one series per model name (and per engine core in newer versions). The
simulator exposes the same names. Values are summed over label sets; a missing series is simply absent.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import httpx

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

CACHE_COUNTERS = (PREFIX_QUERIES, PREFIX_HITS)
QUEUE_GAUGES = (RUNNING, WAITING)


def parse_samples(text: str, names: Collection[str]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` found in Prometheus text exposition ``text``."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if space < 0:
            continue
        labelled = 0 <= brace < space
        name = line[:brace] if labelled else line[:space]
        if name not in names:
            continue
        rest = line[line.rindex("}") + 1 :] if labelled else line[space:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


async def scrape(
    client: httpx.AsyncClient, base_url: str, names: Collection[str], headers: Mapping[str, str] | None = None
) -> dict[str, float] | None:
    """``parse_samples`` of ``GET {base_url}/metrics``; None when the engine does not answer it."""
    try:
        response = await client.get(f"{base_url}/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_samples(response.text, names)
