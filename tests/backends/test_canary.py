"""backends.canary: each failure mode through respx, then the default check against real simulators."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import respx
from simprocs import SimFactory

from backends.canary import Canary, CanaryResult, Check, checks_from_config, needle_text, repeats_one_token
from config.settings import BackendConfig, CanaryConfig

pytestmark = pytest.mark.anyio

URL = "http://engine.test"
CHAT = f"{URL}/v1/chat/completions"
COMPLETIONS = f"{URL}/v1/completions"
CONSISTENCY = Check("consistency", messages=({"role": "user", "content": "planets?"},), timeout_s=2.0)
MATH = Check("math", messages=({"role": "user", "content": "17 x 23?"},), expect="391", timeout_s=2.0)


def chat(content: Any, **message: Any) -> httpx.Response:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, **message}}]}
    return httpx.Response(200, json=body)


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


async def run(client: httpx.AsyncClient, *checks: Check, **kw: Any) -> CanaryResult:
    return await Canary(client, URL, "m", checks, **kw).run()


# -- the default consistency check ------------------------------------------------------------------------


async def test_consistent_answers_pass_and_the_request_is_greedy_and_short(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    route = mock.post(CHAT).mock(return_value=chat("Mercury, Venus, Earth, Mars, Jupiter"))
    result = await run(
        client, CONSISTENCY, api_key="sk-engine", extra_body={"chat_template_kwargs": {"x": 1}}
    )
    assert (result.passed, result.check_name, result.answered_text, result.reason) == (
        True,
        "consistency",
        "Mercury, Venus, Earth, Mars, Jupiter",
        "all 1 checks passed",
    )
    assert route.call_count == 2  # the same prompt twice
    request = route.calls[0].request
    assert json.loads(request.content) == {
        "model": "m",
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": "planets?"}],
        "chat_template_kwargs": {"x": 1},
        "stream": False,
    }
    assert request.headers["authorization"] == "Bearer sk-engine"


async def test_two_differing_greedy_answers_fail(mock: respx.MockRouter, client: httpx.AsyncClient) -> None:
    mock.post(CHAT).mock(side_effect=[chat("Mercury Venus"), chat("Mercury Mars")])
    result = await run(client, CONSISTENCY)
    assert (result.passed, result.check_name, result.answered_text) == (False, "consistency", "Mercury Mars")
    assert result.reason == (
        "check 'consistency' answered 'Mercury Venus', then 'Mercury Mars' to the same greedy prompt"
    )


@pytest.mark.parametrize("answer", ["3333333333333333", "duct duct duct duct duct", "ab ab ab ab ab ab"])
async def test_one_token_repeated_fails_without_asking_twice(
    mock: respx.MockRouter, client: httpx.AsyncClient, answer: str
) -> None:
    route = mock.post(CHAT).mock(return_value=chat(answer))
    result = await run(client, CONSISTENCY)
    assert (result.passed, result.answered_text) == (False, answer)
    assert result.reason == f"check 'consistency' answered one token repeated: {answer!r}"
    assert route.call_count == 1


@pytest.mark.parametrize("content", ["", "   ", None])
async def test_an_empty_answer_fails(mock: respx.MockRouter, client: httpx.AsyncClient, content: Any) -> None:
    mock.post(CHAT).mock(return_value=chat(content))
    result = await run(client, CONSISTENCY)
    assert (result.passed, result.reason) == (False, "check 'consistency' answered nothing")


async def test_a_thinking_model_that_only_reasoned_is_judged_on_its_reasoning(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    mock.post(CHAT).mock(return_value=chat(None, reasoning_content="Okay, the user wants planets"))
    result = await run(client, CONSISTENCY)
    assert (result.passed, result.answered_text) == (True, "Okay, the user wants planets")


# -- knowledge checks ----------------------------------------------------------------------------------


async def test_a_wrong_answer_fails_naming_the_check_and_quoting_the_answer(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    mock.post(CHAT).mock(return_value=chat("17 x 23 = 392"))
    result = await run(client, MATH)
    assert (result.passed, result.check_name, result.answered_text) == (False, "math", "17 x 23 = 392")
    assert result.reason == "check 'math' answered '17 x 23 = 392', expected '391'"


async def test_expect_is_a_case_insensitive_substring_and_asked_once(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    route = mock.post(CHAT).mock(return_value=chat("The capital is PARIS."))
    check = Check("capital", messages=({"role": "user", "content": "capital of France?"},), expect="Paris")
    assert (await run(client, check)).passed is True
    assert route.call_count == 1


async def test_expect_regex_and_the_completions_endpoint(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    route = mock.post(COMPLETIONS).mock(
        side_effect=[httpx.Response(200, json={"choices": [{"text": t}]}) for t in (" 391.", " 3910")]
    )
    check = Check("math-base", prompt="17 * 23 =", pattern=r"\b391\b", max_tokens=4)
    assert (await run(client, check)).passed is True
    result = await run(client, check)
    assert result.reason == r"check 'math-base' answered ' 3910', expected /\b391\b/"
    assert json.loads(route.calls[0].request.content)["prompt"] == "17 * 23 ="


async def test_the_first_failure_ends_the_run(mock: respx.MockRouter, client: httpx.AsyncClient) -> None:
    route = mock.post(CHAT).mock(return_value=chat("3333333333"))
    result = await run(client, CONSISTENCY, MATH)
    assert result.check_name == "consistency"
    assert route.call_count == 1  # math was never asked


async def test_all_passing_reports_the_last_check(mock: respx.MockRouter, client: httpx.AsyncClient) -> None:
    mock.post(CHAT).mock(return_value=chat("391"))
    result = await run(client, CONSISTENCY, MATH)
    assert (result.passed, result.check_name, result.answered_text, result.reason) == (
        True,
        "math",
        "391",
        "all 2 checks passed",
    )


# -- what the engine may do wrong ---------------------------------------------------------------------


async def test_a_stalled_engine_fails_its_check_at_the_deadline(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    async def stall(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return chat("late")

    mock.post(CHAT).mock(side_effect=stall)
    check = Check("consistency", messages=({"role": "user", "content": "x"},), timeout_s=0.05)
    started = time.monotonic()
    result = await run(client, check)
    assert time.monotonic() - started < 10  # the engine answers after 30 s; 10 allows a loaded machine
    assert (result.passed, result.answered_text) == (False, None)
    assert result.reason == "check 'consistency' got no answer within 0.05 s"


async def test_an_httpx_timeout_is_reported_as_the_deadline(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    mock.post(CHAT).mock(side_effect=httpx.ReadTimeout("read timed out"))
    result = await run(client, MATH)
    assert (result.passed, result.reason) == (False, "check 'math' got no answer within 2 s")


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (
            httpx.Response(200, text="<html>oops</html>"),
            "check 'math': not an OpenAI answer: '<html>oops</html>'",
        ),
        (
            httpx.Response(200, json={"object": "error"}),
            """check 'math': not an OpenAI answer: '{"object":"error"}'""",
        ),
        (
            httpx.Response(200, json={"choices": []}),
            """check 'math': not an OpenAI answer: '{"choices":[]}'""",
        ),
        (
            httpx.Response(200, json={"choices": ["x"]}),
            """check 'math': not an OpenAI answer: '{"choices":["x"]}'""",
        ),
        (httpx.Response(500, text="CUDA error"), "check 'math': HTTP 500: 'CUDA error'"),
    ],
    ids=["not-json", "no-choices", "empty-choices", "choice-not-object", "http-500"],
)
async def test_garbage_answers_fail_with_what_came_back(
    mock: respx.MockRouter, client: httpx.AsyncClient, response: httpx.Response, reason: str
) -> None:
    mock.post(CHAT).mock(return_value=response)
    result = await run(client, MATH)
    assert (result.passed, result.reason, result.answered_text) == (False, reason, None)


async def test_a_refused_connection_fails(mock: respx.MockRouter, client: httpx.AsyncClient) -> None:
    mock.post(CHAT).mock(side_effect=httpx.ConnectError("connection refused"))
    result = await run(client, MATH)
    assert result.reason == "check 'math': request failed: ConnectError: connection refused"


async def test_a_long_answer_is_quoted_short_and_kept_bounded(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    mock.post(CHAT).mock(return_value=chat("no " + "x" * 5000))
    result = await run(client, MATH)
    assert result.reason == f"check 'math' answered {('no ' + 'x' * 197 + '…')!r}, expected '391'"
    assert result.answered_text == "no " + "x" * 1997 + "…"


# -- configuration -----------------------------------------------------------------------------------------


def test_checks_from_config_in_order_with_their_deadlines() -> None:
    cfg = CanaryConfig(
        checks=[
            {"name": "math", "messages": [{"role": "user", "content": "17*23?"}], "expect": "391"},
            {"name": "base", "prompt": "2+2=", "expect_regex": "4", "max_tokens": 3, "timeout_s": 5},
        ],
        needle_tokens=[1000],
        timeout_s=7,
        needle_timeout_s=90,
    )
    checks = checks_from_config(cfg)
    assert [(c.name, c.consistency, c.timeout_s) for c in checks] == [
        ("consistency", True, 7),
        ("math", False, 7),
        ("base", False, 5),
        ("needle-1000", False, 90),
    ]
    assert checks[2] == Check("base", None, "2+2=", None, "4", 3, 5)
    assert checks_from_config(CanaryConfig(enabled=False)) == ()
    assert [c.name for c in checks_from_config(CanaryConfig(consistency=False))] == []


async def test_a_disabled_canary_passes_at_once(client: httpx.AsyncClient) -> None:
    result = await Canary(client, URL, "m", ()).run()
    assert (result.passed, result.check_name, result.reason) == (True, None, "no canary checks configured")


async def test_for_backend_prefers_the_backends_own_section(client: httpx.AsyncClient) -> None:
    own = CanaryConfig(consistency=False, checks=[{"name": "q", "prompt": "x", "expect": "y"}])
    backend = BackendConfig(id="a", url=URL, models=("first", "second"), api_key="k", canary=own)
    canary = Canary.for_backend(client, backend, CanaryConfig())
    assert ([c.name for c in canary.checks], canary.model, canary.headers) == (
        ["q"],
        "first",
        {"authorization": "Bearer k"},
    )
    plain = BackendConfig(id="b", url=URL, models=("m",))
    assert [c.name for c in Canary.for_backend(client, plain, CanaryConfig()).checks] == ["consistency"]


def test_bad_checks_are_rejected() -> None:
    with pytest.raises(ValueError, match="exactly one of messages or prompt"):
        Check("x")
    with pytest.raises(ValueError, match="exactly one of messages or prompt"):
        CanaryConfig(checks=[{"name": "x", "prompt": "p", "messages": [{"role": "user", "content": "p"}]}])
    with pytest.raises(ValueError, match="expect_regex does not compile"):
        CanaryConfig(checks=[{"name": "x", "prompt": "p", "expect_regex": "("}])
    with pytest.raises(ValueError, match="names must be unique"):
        CanaryConfig(checks=[{"name": "consistency", "prompt": "p", "expect": "q"}])


@pytest.mark.parametrize(
    ("text", "repeated"),
    [
        ("3333333333", True),
        ("duct duct duct", True),
        ("duct duct duct duct d", True),  # cut at the length limit mid-word
        ("hahahaha", True),
        ("Mercury, Venus, Earth, Mars, Jupiter", False),
        ("no no", False),
        ("391", False),
        ("1 2 3 4 5 6", False),
        ("abcabc", False),  # two repeats of a 3-character unit: too few to judge
    ],
)
def test_repeats_one_token(text: str, repeated: bool) -> None:
    assert repeats_one_token(text) is repeated


# -- the needle check --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [64, 4000, 32000])
def test_needle_text_hides_one_passphrase_in_the_middle_at_about_the_length(tokens: int) -> None:
    prompt, passphrase = needle_text(tokens)
    assert prompt.count(passphrase) == 1
    position = prompt.index(passphrase) / len(prompt)
    assert 0.3 < position < 0.7 or tokens == 64
    assert 0.5 * tokens < len(prompt.split()) * 1.3 <= tokens  # ~1.3 tokens a word: never over the length
    assert needle_text(tokens) == (prompt, passphrase)  # deterministic: a byte-stable prompt


async def test_needle_check_passes_when_the_passphrase_comes_back(
    mock: respx.MockRouter, client: httpx.AsyncClient
) -> None:
    prompt, passphrase = needle_text(2000)
    mock.post(CHAT).mock(
        side_effect=[chat(f"The passphrase is {passphrase.upper()}."), chat("I don't know.")]
    )
    cfg = CanaryConfig(consistency=False, needle_tokens=[2000])
    (check,) = checks_from_config(cfg)
    assert (check.messages, check.expect) == (({"role": "user", "content": prompt},), passphrase)
    assert (await run(client, check)).passed is True
    assert (
        await run(client, check)
    ).reason == f"check 'needle-2000' answered \"I don't know.\", expected {passphrase!r}"


# -- against the engine simulator, a real process ------------------------------------------------------


async def test_simulators_normal_passes_repeating_fails_stalled_times_out(
    sims: SimFactory, client: httpx.AsyncClient
) -> None:
    normal, repeating, stalled = sims([], ["--repeat-token"], ["--stall-s", "30"])
    backend = BackendConfig(id="sim", url=normal, models=("sim-model",))
    passed = await Canary.for_backend(client, backend, CanaryConfig()).run()
    assert (passed.passed, passed.check_name, passed.reason) == (True, "consistency", "all 1 checks passed")
    assert passed.answered_text and not repeats_one_token(passed.answered_text)

    failed = await Canary.for_backend(
        client, backend.model_copy(update={"url": repeating}), CanaryConfig()
    ).run()
    assert (failed.passed, failed.check_name) == (False, "consistency")
    assert failed.answered_text == " ".join(["duct"] * 16)  # max_tokens 16
    assert failed.reason == f"check 'consistency' answered one token repeated: {failed.answered_text!r}"

    started = time.monotonic()
    cfg = CanaryConfig(timeout_s=0.3)
    timed_out = await Canary.for_backend(client, backend.model_copy(update={"url": stalled}), cfg).run()
    assert time.monotonic() - started < 10  # the simulator answers after 30 s; 10 allows a loaded machine
    assert (timed_out.passed, timed_out.reason) == (False, "check 'consistency' got no answer within 0.3 s")
