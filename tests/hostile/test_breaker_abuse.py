"""What one client's requests can do to the engines' circuit breakers, through real sockets.

Defect: any body the engines answered with a 5xx counted against their breakers for everyone, so a few
"poison pill" requests gave every client 503s for an open period (at 10 req/s an attacker failed 39 of 40
legitimate requests). The rule (gateway/blame.py): a 5xx that the same request also got from another
engine is the request's own and counts for nobody; a 5xx nobody else was asked about counts per client,
and one client alone never opens a breaker. An engine that is really broken still opens its breaker.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hostile_engine import RESET, Conn, HostileEngine, RawRequest, Script, ok_json, response, steps
from hostile_gateway import HostileGateway, HostileGatewayFactory, lines

POISON = "poison-pill"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
HOSTILE = {"model": "m", "messages": [{"role": "user", "content": f"please choke on this: {POISON}"}]}
ANSWER = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]}
CHOKED = {"error": {"message": "engine choked on its input", "type": "server_error"}}
#: The strictest breaker: one counted failure opens it for longer than any test runs.
ONE_STRIKE = {"failure_threshold": 1, "open_s": 600, "open_max_s": 600}
OWN_FAILURE = "the request's own failure, held against neither breaker"


def chokes_on_poison() -> Script:
    """A healthy engine with one bug: a body containing POISON makes it answer 500."""

    async def run(request: RawRequest, conn: Conn) -> None:
        script = ok_json(CHOKED, 500) if POISON.encode() in request.body else ok_json(ANSWER)
        await script(request, conn)

    return run


def engine(chat: Script) -> HostileEngine:
    """/health always fine (the health checker keeps it READY), /v1/chat/completions as scripted."""
    return HostileEngine({"/health": steps(response(200)), "/v1/chat/completions": chat})


def generations(e: HostileEngine, marker: str = "") -> int:
    """Generation requests the engine received (those whose body holds ``marker``)."""
    return sum(1 for r in e.requests if r.path == "/v1/chat/completions" and marker.encode() in r.body)


def post(c: HostileGateway, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.post(c.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def breakers(c: HostileGateway) -> dict[str, tuple[str, int]]:
    """Each backend's (circuit, consecutive failures) as its controller holds them."""
    fleet = c.gateway.fleet.controllers
    return {bid: (ctl.status()["circuit"], ctl.breaker.consecutive_failures) for bid, ctl in fleet.items()}


def test_a_body_every_engine_fails_opens_no_breaker_and_other_clients_are_served(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    bursts, mixed = 10, 20
    a, b = engine(chokes_on_poison()), engine(chokes_on_poison())
    with a.serve() as url_a, b.serve() as url_b:
        c = hostile_gateway(engines=[], raw_engines={"a": url_a, "b": url_b}, breaker=ONE_STRIKE)
        assert [post(c, HOSTILE).status_code for _ in range(bursts)] == [500] * bursts
        assert breakers(c) == {"a": ("closed", 0), "b": ("closed", 0)}
        # The attacker keeps going while another client works: every legitimate request is answered.
        answers = [post(c, body).status_code for _ in range(mixed) for body in (HOSTILE, CHAT)]
        assert answers == [500, 200] * mixed
        assert breakers(c) == {"a": ("closed", 0), "b": ("closed", 0)}
        assert c.gateway.registry.total_in_flight() == 0
    hostile = bursts + mixed
    # Each hostile request was tried once on each engine (the retry), each legitimate one on one engine.
    assert (generations(a, POISON), generations(b, POISON)) == (hostile, hostile)
    assert generations(a) + generations(b) == 2 * hostile + mixed
    said = [r.getMessage() for r in lines(gateway_log) if OWN_FAILURE in r.getMessage()]
    assert len(said) == hostile  # one line per hostile request
    assert said[0].startswith("POST /v1/chat/completions from peer:127.0.0.1: 500 from backend ")


def test_one_client_cannot_open_the_breaker_of_an_engine_that_is_alone_for_its_model(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # No second engine to ask: the 5xx is unconfirmed, counted per client; one client never opens it.
    a = engine(chokes_on_poison())
    with a.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"a": url}, breaker=ONE_STRIKE)
        assert [post(c, HOSTILE).status_code for _ in range(10)] == [500] * 10
        assert breakers(c) == {"a": ("closed", 10)}
        assert [post(c, CHAT).status_code for _ in range(3)] == [200] * 3
        assert breakers(c) == {"a": ("closed", 0)}
    assert (generations(a, POISON), generations(a)) == (10, 13)


def test_an_engine_that_answers_everyone_503_opens_once_two_clients_had_one(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    keys = [{"name": "x", "key": "key-of-x"}, {"name": "y", "key": "key-of-y"}]
    a = engine(ok_json({"error": {"message": "overloaded"}}, 503))
    with a.serve() as url:
        c = hostile_gateway(
            engines=[], raw_engines={"a": url}, breaker=ONE_STRIKE, auth={"client_keys": keys}
        )
        x1, x2 = post(c, CHAT, "key-of-x"), post(c, CHAT, "key-of-x")
        assert [x1.json(), x2.json()] == [{"error": {"message": "overloaded"}}] * 2  # the engine's own
        assert breakers(c) == {"a": ("closed", 2)}
        assert post(c, CHAT, "key-of-y").status_code == 503  # a second client: the engine's fault
        assert breakers(c) == {"a": ("open", 3)}
        refused = post(c, CHAT, "key-of-x")
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_healthy_backend")
    assert generations(a) == 3


@pytest.mark.parametrize(
    ("name", "chat"),
    [
        ("answers 503 to everything", ok_json({"error": {"message": "overloaded"}}, 503)),
        ("resets every generation connection", steps(RESET)),
    ],
)
def test_a_broken_engine_beside_a_healthy_one_still_opens_its_breaker(
    hostile_gateway: HostileGatewayFactory, name: str, chat: Script
) -> None:
    # Its failures are its own: the same requests are answered by the other engine (or it never answered).
    threshold = 2
    sick, well = engine(chat), engine(ok_json(ANSWER))
    breaker = {**ONE_STRIKE, "failure_threshold": threshold}
    with sick.serve() as url_sick, well.serve() as url_well:
        c = hostile_gateway(engines=[], raw_engines={"sick": url_sick, "well": url_well}, breaker=breaker)
        answers = []
        while generations(sick) < threshold:
            answers.append(post(c, {**CHAT, "messages": [{"role": "user", "content": str(len(answers))}]}))
            assert len(answers) <= 20, "the sick engine was never chosen"
        assert breakers(c)["sick"][0] == "open", name
        assert [r.status_code for r in answers] == [200] * len(answers)
        assert {r.headers["x-warmroute-backend"] for r in answers} == {"well"}
        more = [post(c, CHAT).status_code for _ in range(5)]
        assert more == [200] * 5
        assert c.gateway.registry.total_in_flight() == 0
        assert breakers(c)["well"] == ("closed", 0)
    assert generations(sick) == threshold  # nothing more reached it once open
