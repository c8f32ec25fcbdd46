"""The official ``anthropic`` SDK as the caller, against the gateway in front of fake Anthropic engines: its
messages, streams and token counts work, and the gateway's errors read as the SDK's own exception classes."""

from __future__ import annotations

import functools
from datetime import UTC, datetime

import anthropic
import pytest
from messages_engine import COUNTED, AnthropicEngine

from clusters import Cluster, ClusterFactory

KEY = "sk-team"


@pytest.fixture
def cluster(cluster: ClusterFactory) -> ClusterFactory:
    """Fake engines that serve /v1/messages natively (for the default dialect, openai, it is translated)."""
    return functools.partial(cluster, backend={"native_shapes": ["chat", "completions", "messages"]})


@pytest.fixture
def c(cluster: ClusterFactory) -> Cluster:
    return cluster(
        engines=[AnthropicEngine("a"), AnthropicEngine("b")],
        auth={"client_keys": [{"name": "team", "key": KEY}]},
    )


def client(c: Cluster, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=c.url, api_key=key, max_retries=0, timeout=10)


USER = [{"role": "user", "content": "fix the bug"}]


def test_messages_streams_and_counts_through_the_sdk_stay_with_their_conversation(c: Cluster) -> None:
    sdk = client(c)
    first = sdk.messages.with_raw_response.create(model="m", max_tokens=64, system="agent", messages=USER)
    home = first.headers["x-warmroute-backend"]
    message = first.parse()
    assert message.content[0].type == "text" and message.content[0].text == f"{home}-0 {home}-1 {home}-2 "
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (3, 5)
    follow = [
        *USER,
        {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "go"},
    ]
    with sdk.messages.stream(model="m", max_tokens=64, system="agent", messages=follow) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == f"{home}-0 {home}-1 {home}-2 "
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 4)
    counted = sdk.messages.with_raw_response.count_tokens(model="m", system="agent", messages=follow)
    assert (counted.parse().input_tokens, counted.headers["x-warmroute-route"]) == (COUNTED, "affinity_hit")
    assert len(c.engines[home].requests) == 3  # every turn, and the count, on the conversation's engine
    assert c.engines["b" if home == "a" else "a"].requests == []


def test_the_gateway_s_errors_are_the_sdk_s_own_exception_classes(c: Cluster) -> None:
    sdk = client(c)
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(
            model="m", max_tokens=2048, messages=USER, thinking={"type": "enabled", "budget_tokens": 100}
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="nope", max_tokens=16, messages=USER)
    assert missing.value.type == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(c, "sk-wrong").messages.create(model="m", max_tokens=16, messages=USER)
    assert denied.value.type == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.count_tokens(model="m", messages=[{"role": "tool", "content": "x"}])
    assert c.engines["a"].requests == c.engines["b"].requests == []


def test_a_stream_that_breaks_raises_the_sdk_s_api_error(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a", chunks=5, die_after=2)])
    sdk = anthropic.Anthropic(base_url=c.url, api_key="unused", max_retries=0, timeout=10)
    seen: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError) as broken,
        sdk.messages.stream(model="m", max_tokens=64, messages=USER) as stream,
    ):
        seen.extend(stream.text_stream)
    assert seen == ["", "a-0 ", "a-1 "] or seen == ["a-0 ", "a-1 "]
    assert broken.value.body["error"]["type"] == "api_error"
    c.wait_idle()


def test_a_quota_refusal_reads_as_the_sdks_rate_limit_error_with_its_headers(cluster: ClusterFactory) -> None:
    c = cluster(
        engines=[AnthropicEngine("a")],
        auth={"client_keys": [{"name": "team", "key": KEY}]},
        quotas={"keys": {"team": {"requests_per_window": 1, "tokens_per_window": 100_000}}, "window_s": 30},
    )
    sdk = client(c)  # max_retries=0: the 429 is observed, not retried
    ok = sdk.messages.with_raw_response.create(model="m", max_tokens=64, messages=USER)
    assert ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert "x-ratelimit-limit-requests" not in ok.headers
    with pytest.raises(anthropic.RateLimitError) as refused:
        sdk.messages.create(model="m", max_tokens=64, messages=USER)
    headers = refused.value.response.headers
    assert refused.value.status_code == 429 and refused.value.type == "rate_limit_error"
    assert headers["anthropic-ratelimit-requests-limit"] == "1"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    reset = datetime.fromisoformat(headers["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo is not None and 0 < (reset - datetime.now(UTC)).total_seconds() <= 31
    assert 1 <= int(headers["retry-after"]) <= 30
    # what the SDK itself would wait before a retry: the gateway's Retry-After (it honours up to 60 s)
    assert sdk._parse_retry_after_header(headers) == float(headers["retry-after"])
    assert len(c.engines["a"].requests) == 1  # the refused request never reached the engine
