"""The gateway in front of real engines, in-process, and the client-side helpers the e2e tests share.

A gateway is `create_app(settings)` served by uvicorn in a thread (`upstreams.serve`); the tests talk to it
with the official `openai` client, as a user would. Backend ids are the engines' names (`engine-0`, ...), so
the `x-warmroute-backend` header names a `VllmEngine` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from config.settings import load_settings
from gateway.app import Gateway, create_app

from .engines import PrefixCacheStats, VllmEngine
from .prompts import filler_text
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

MODEL = "tiny-chat"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BLOCK = 128  # vLLM's KV block: only whole blocks of a prompt are cached and reused
BACKEND_HEADER = "x-warmroute-backend"
ROUTE_HEADER = "x-warmroute-route"
# Short health interval and a single failure to mark a backend down: a killed engine is noticed quickly.
FAST_HEALTH = {"interval_s": 0.5, "timeout_s": 5.0, "fail_threshold": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class RunningGateway:
    url: str  # server root; the OpenAI base_url is url + "/v1"
    policy: str
    gateway: Gateway

    def client(self, timeout_s: float = 120.0) -> OpenAI:
        """The official client, with its own retries off: every failure the gateway lets through shows."""
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def in_flight(self) -> int:
        return self.gateway.registry.total_in_flight()

    def wait_idle(self, timeout_s: float = 5.0) -> int:
        """Wait until the gateway holds no request; return what it still holds (0 on success)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.in_flight()

    def backend_state(self, backend_id: str) -> str:
        return self.gateway.registry.backends[backend_id].state.value

    def wait_state(self, backend_id: str, state: str, timeout_s: float = 15.0) -> str:
        deadline = time.monotonic() + timeout_s
        while self.backend_state(backend_id) != state and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.backend_state(backend_id)


@contextlib.contextmanager
def running_gateway(
    engines: Sequence[VllmEngine], policy: str = "affinity", **overrides: Any
) -> Iterator[RunningGateway]:
    """A gateway (in-memory state) in front of `engines` on 127.0.0.1, for the duration of the block."""
    backends = [
        {"id": e.name, "url": e.base_url, "models": [e.config.served_model_name], "dialect": "vllm"}
        for e in engines
    ]
    overrides.setdefault("health", FAST_HEALTH)
    routing = {"policy": policy, **overrides.pop("routing", {})}
    settings = load_settings(None, backends=backends, routing=routing, **overrides)
    app = create_app(settings)
    with serve(app) as (url, _server):
        yield RunningGateway(url, policy, app.state.gateway)


# -- conversations ----------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Turn:
    """One answered turn, as the client and the engines saw it."""

    conversation: str
    number: int  # 1-based
    backend: str
    route: str
    prompt_tokens: int
    reply: str
    seconds: float  # the whole request, as the client saw it
    cache: dict[str, PrefixCacheStats]  # per engine: counter deltas over this turn (sequential turns only)

    @property
    def served(self) -> PrefixCacheStats:
        return self.cache[self.backend]


@dataclasses.dataclass(slots=True)
class Conversation:
    """A chat whose history grows every turn: a long first message, then `turn_tokens` more per turn.

    The tag leads the first message, so two conversations share no cached prefix beyond the template's first
    few tokens (less than a block) and each has its own routing key.
    """

    tag: str
    first_tokens: int = 2000
    turn_tokens: int = 500
    messages: list[ChatCompletionMessageParam] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)

    def next_user_message(self) -> ChatCompletionMessageParam:
        n = len(self.turns)
        size = self.first_tokens if n == 0 else self.turn_tokens
        return {"role": "user", "content": filler_text(size, f"{self.tag}-t{n + 1}")}

    @property
    def backends(self) -> set[str]:
        return {t.backend for t in self.turns}


def ask(
    client: OpenAI,
    conv: Conversation,
    engines: Sequence[VllmEngine] = (),
    *,
    max_tokens: int = 4,
    stream: bool = False,
) -> Turn:
    """Send the conversation's next turn through the gateway; append the reply to its history.

    With `engines`, also read each engine's prefix-cache counters before and after (settled), so the turn
    knows which engine's cache it used. Only meaningful while nothing else runs on the engines.
    """
    user = conv.next_user_message()
    messages = [*conv.messages, user]
    before = {e.name: e.prefix_cache() for e in engines}
    started = time.perf_counter()
    if stream:
        reply, backend, route, prompt_tokens = _ask_streamed(client, messages, max_tokens)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=NO_THINKING
        )
        completion: ChatCompletion = raw.parse()
        assert completion.usage is not None
        reply = completion.choices[0].message.content or ""
        backend, route = raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER]
        prompt_tokens = completion.usage.prompt_tokens
    seconds = time.perf_counter() - started
    cache: dict[str, PrefixCacheStats] = {}
    for engine in engines:
        then = before[engine.name]
        if engine.name == backend:
            now = settled(engine.prefix_cache, _counted(then, prompt_tokens))
        else:
            now = engine.prefix_cache() if engine.alive else then
        cache[engine.name] = now - then
    conv.messages = [*messages, {"role": "assistant", "content": reply}]
    turn = Turn(conv.tag, len(conv.turns) + 1, backend, route, prompt_tokens, reply, seconds, cache)
    conv.turns.append(turn)
    return turn


def _counted(then: PrefixCacheStats, tokens: int) -> Callable[[PrefixCacheStats], bool]:
    """True once the counters show `tokens` more queried tokens than `then`: the turn is published."""
    return lambda now: (now - then).queries >= tokens


def _ask_streamed(
    client: OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> tuple[str, str, str, int]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    parts: list[str] = []
    prompt_tokens = 0
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    assert prompt_tokens, "the stream ended without its usage chunk"
    return "".join(parts), raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER], prompt_tokens


def settled(
    read: Callable[[], PrefixCacheStats], done: Callable[[PrefixCacheStats], bool], timeout_s: float = 5.0
) -> PrefixCacheStats:
    """Counters are published a moment after the reply; poll briefly instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def hit_rate(turns: Sequence[Turn]) -> float:
    """Prefix-cache hits over queries, in tokens, summed over the turns and all engines."""
    hits = sum(s.hits for t in turns for s in t.cache.values())
    queries = sum(s.queries for t in turns for s in t.cache.values())
    return hits / queries if queries else 0.0
