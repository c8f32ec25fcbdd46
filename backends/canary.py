"""Canary checks: short greedy questions a backend must answer well before it takes traffic (and after
every outage), because an engine can pass its health checks and still answer ``3333…`` to every prompt.

Checks run in order and the first failure ends the run. Each is greedy (``temperature: 0``), short
(``max_tokens``) and has its own deadline for the whole check, so a stalled engine fails its canary in
``timeout_s`` instead of hanging anything. Kinds (see ``config.settings.CanaryCheckConfig``):

- consistency (the default; needs no knowledge of the model): the same prompt twice; both answers must be
  equal, non-empty and not one token repeated;
- knowledge: the answer contains ``expect`` (case-insensitive) or matches ``expect_regex``;
- needle: a long filler text of about N tokens hides one passphrase; the answer must contain it.

The answer is the message content, or the reasoning text when a thinking model spent its few tokens there.
A failure's reason names the check and quotes what the engine answered: it goes to the logs and /readyz.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from backends.dialects import REASONING_FIELDS
from config.settings import BackendConfig, CanaryConfig

_QUOTE_CHARS = 200  # of an answer quoted in a reason
_KEEP_CHARS = 2000  # of an answer kept in the result
_REPEAT_MAX_PERIOD = 8  # characters of a repeated unit ("3", "duct")
_REPEAT_MIN_COUNT = 4


@dataclass(frozen=True, slots=True)
class Check:
    """One check. Neither ``expect`` nor ``pattern``: a consistency check."""

    name: str
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    expect: str | None = None
    pattern: str | None = None
    max_tokens: int = 16
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError(f"check {self.name!r}: give exactly one of messages or prompt")

    @property
    def consistency(self) -> bool:
        return self.expect is None and self.pattern is None


@dataclass(frozen=True, slots=True)
class CanaryResult:
    passed: bool
    check_name: str | None  # the failed check; the last one run when all passed; None if none ran
    answered_text: str | None  # what that check's engine answered (None: no answer at all)
    reason: str
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Failed(Exception):
    def __init__(self, reason: str, answered: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answered = answered


def checks_from_config(cfg: CanaryConfig) -> tuple[Check, ...]:
    """Consistency first, then the knowledge questions, then the (slow) needle checks."""
    if not cfg.enabled:
        return ()
    checks: list[Check] = []
    if cfg.consistency:
        user = {"role": "user", "content": cfg.consistency_prompt}
        checks.append(
            Check("consistency", messages=(user,), max_tokens=cfg.max_tokens, timeout_s=cfg.timeout_s)
        )
    for c in cfg.checks:
        timeout_s = c.timeout_s or cfg.timeout_s
        checks.append(Check(c.name, c.messages, c.prompt, c.expect, c.expect_regex, c.max_tokens, timeout_s))
    checks.extend(needle_check(n, cfg.needle_timeout_s) for n in cfg.needle_tokens)
    return tuple(checks)


class Canary:
    """Runs ``checks`` against one backend; ``run`` never raises for anything the engine does."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        checks: Sequence[Check],
        *,
        api_key: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.checks = tuple(checks)
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra_body = dict(extra_body or {})
        self.clock = clock

    @classmethod
    def for_backend(cls, client: httpx.AsyncClient, cfg: BackendConfig, defaults: CanaryConfig) -> Canary:
        """The backend's own ``canary:`` section if it has one, else the top-level one; its first model."""
        canary = cfg.canary or defaults
        checks = checks_from_config(canary)
        return cls(client, cfg.url, cfg.models[0], checks, api_key=cfg.api_key, extra_body=canary.extra_body)

    async def run(self) -> CanaryResult:
        started = self.clock()
        last: tuple[str | None, str | None] = (None, None)
        for check in self.checks:
            try:
                async with asyncio.timeout(check.timeout_s):
                    answered = await self._check(check)
            except TimeoutError:
                reason = f"check {check.name!r} got no answer within {check.timeout_s:g} s"
                return CanaryResult(False, check.name, None, reason, self.clock() - started)
            except _Failed as failed:
                kept = _keep(failed.answered)
                return CanaryResult(False, check.name, kept, failed.reason, self.clock() - started)
            last = (check.name, _keep(answered))
        reason = f"all {len(self.checks)} checks passed" if self.checks else "no canary checks configured"
        return CanaryResult(True, *last, reason, self.clock() - started)

    async def _check(self, check: Check) -> str:
        """The answered text when the check passes; ``_Failed`` otherwise."""
        first = await self._ask(check)
        if not first.strip():
            raise _Failed(f"check {check.name!r} answered nothing", first)
        if check.consistency:
            if repeats_one_token(first):
                raise _Failed(f"check {check.name!r} answered one token repeated: {_quote(first)}", first)
            second = await self._ask(check)
            if second != first:
                raise _Failed(
                    f"check {check.name!r} answered {_quote(first)}, then {_quote(second)} to the same "
                    "greedy prompt",
                    second,
                )
        elif check.expect is not None and check.expect.casefold() not in first.casefold():
            raise _Failed(f"check {check.name!r} answered {_quote(first)}, expected {check.expect!r}", first)
        elif check.pattern is not None and re.search(check.pattern, first) is None:
            raise _Failed(f"check {check.name!r} answered {_quote(first)}, expected /{check.pattern}/", first)
        return first

    async def _ask(self, check: Check) -> str:
        chat = check.messages is not None
        body: dict[str, Any] = {"model": self.model, "max_tokens": check.max_tokens, "temperature": 0}
        body.update({"messages": list(check.messages or ())} if chat else {"prompt": check.prompt})
        body.update(self.extra_body)
        body["stream"] = False
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            resp = await self.client.post(
                self.base_url + path, json=body, headers=self.headers, timeout=httpx.Timeout(check.timeout_s)
            )
        except httpx.TimeoutException:
            raise TimeoutError from None  # reported as the check's deadline
        except httpx.HTTPError as exc:
            raise _Failed(f"check {check.name!r}: request failed: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise _Failed(f"check {check.name!r}: HTTP {resp.status_code}: {_quote(resp.text)}")
        try:
            text = answer_text(resp.json(), chat)
        except ValueError:
            text = None
        if text is None:
            raise _Failed(f"check {check.name!r}: not an OpenAI answer: {_quote(resp.text)}")
        return text


def answer_text(data: Any, chat: bool) -> str | None:
    """The generated text of an OpenAI response body; None when it has not that shape."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(choice, dict):
        return None
    if not chat:
        text = choice.get("text")
        return text if isinstance(text, str) else None
    message = choice.get("message")
    if not isinstance(message, dict):
        return None
    for key in ("content", *REASONING_FIELDS):  # thinking models may answer only there
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return ""


def repeats_one_token(text: str) -> bool:
    """``duct duct duct``, ``3333333333``, ``ababab…``: one short unit over and over."""
    words = text.split()
    if len(words) >= 3 and len(set(words)) == 1:
        return True
    joined = "".join(words)
    for period in range(1, _REPEAT_MAX_PERIOD + 1):
        if len(joined) < period * _REPEAT_MIN_COUNT:
            break
        unit = joined[:period]
        if (unit * (len(joined) // period + 1)).startswith(joined):
            return True
    return False


# -- the needle check -------------------------------------------------------------------------------------

_SUBJECTS = (
    "The old harbour",
    "A quiet archive",
    "The northern road",
    "Every spring market",
    "The glass tower",
)
_VERBS = ("keeps", "remembers", "hides", "carries", "watches over")
_OBJECTS = (
    "a ledger of ships",
    "seven brass keys",
    "the winter maps",
    "a row of lanterns",
    "the first letters",
)
_TAILS = (
    "since the flood.",
    "for the guild.",
    "without a word.",
    "through the long nights.",
    "as it always has.",
)
_COLOURS = ("amber", "cobalt", "crimson", "jade", "silver", "violet")
_ANIMALS = ("falcon", "otter", "lynx", "heron", "badger", "marten")
_TOKENS_PER_SENTENCE = 15  # 11 words at ~1.3 tokens a word: rather under the length than over it


def needle_text(tokens: int) -> tuple[str, str]:
    """A prompt of about ``tokens`` tokens hiding a passphrase in its middle, and the passphrase."""
    passphrase = f"{_COLOURS[tokens % 6]}-{_ANIMALS[tokens // 6 % 6]}-{1000 + tokens * 7919 % 9000}"
    count = max(2, tokens // _TOKENS_PER_SENTENCE - 4)  # leave room for the needle and the question
    sentences = [
        f"{_SUBJECTS[i % 5]} {_VERBS[i // 5 % 5]} {_OBJECTS[i // 25 % 5]} {_TAILS[i // 125 % 5]}"
        for i in range(count)
    ]
    sentences.insert(count // 2, f"The passphrase for the vault is {passphrase}.")
    question = "What is the passphrase for the vault in the text above? Reply with the passphrase only."
    return " ".join(sentences) + "\n\n" + question, passphrase


def needle_check(tokens: int, timeout_s: float = 300.0) -> Check:
    prompt, passphrase = needle_text(tokens)
    user = {"role": "user", "content": prompt}
    return Check(f"needle-{tokens}", messages=(user,), expect=passphrase, max_tokens=24, timeout_s=timeout_s)


def _quote(text: str) -> str:
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "…")


def _keep(text: str | None) -> str | None:
    return text if text is None or len(text) <= _KEEP_CHARS else text[:_KEEP_CHARS] + "…"
