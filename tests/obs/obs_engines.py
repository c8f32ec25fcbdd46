"""Helpers of the observability tests: an engine that reports usage (cached tokens too), scrapes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from upstreams import FakeEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
PROMPT_TOKENS, CACHED_TOKENS = 11, 7  # what UsageEngine reports for every answer

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class UsageEngine(FakeEngine):
    """A FakeEngine whose answers carry ``usage`` with ``prompt_tokens_details.cached_tokens``, streamed
    ones in a final chunk (as vLLM does with ``stream_options.include_usage``)."""

    def _usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": self.chunks,
            "total_tokens": PROMPT_TOKENS + self.chunks,
            "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
        }

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**super()._completion(body), "usage": self._usage()}

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async for chunk in super()._stream(body):
            if chunk == b"data: [DONE]\n\n":
                final = {
                    "id": "cmpl-1",
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": self._usage(),
                }
                yield f"data: {json.dumps(final)}\n\n".encode()
            yield chunk


def scrape_text(url: str) -> str:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    return r.text


def scrape(url: str) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one series (zeros included), keyed by its sorted labels."""
    return {labels: value for (n, labels), value in scrape(url).items() if n == name}


def nonzero(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for labels, value in samples(url, name).items() if value}


def labels(**kv: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kv.items()))
