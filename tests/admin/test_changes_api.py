"""``GET /admin/changes``: a long poll on the gateway's announcements, answered by the change itself."""

from __future__ import annotations

import threading

import httpx
import pytest

from admin_helpers import chat
from clusters import ClusterFactory


def changes(url: str, **query: object) -> httpx.Response:
    return httpx.get(url + "/admin/changes", params=query, timeout=60)


def test_a_long_poll_answers_with_the_change_not_at_its_deadline(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    c.wait_for(lambda: all(b.state.value == "ready" for b in c.gateway.registry.backends.values()), "ready")
    first = changes(c.url)
    assert first.status_code == 200
    version = first.json()["version"]
    assert version == c.gateway.changes.version and version >= 4  # a and b each: canary, ready

    answers: list[httpx.Response] = []
    parked = threading.Event()

    def poll() -> None:
        parked.set()
        answers.append(changes(c.url, since=version, wait_s=30))

    poller = threading.Thread(target=poll)
    poller.start()
    assert parked.wait(10)
    # Parked (or about to be: then the version has moved and it answers at once, with the same body).
    assert httpx.post(c.url + "/admin/backends/a/drain", timeout=10).status_code == 200
    poller.join(20)
    assert not poller.is_alive(), "the long poll ran to its 30 s deadline: the drain did not wake it"
    (answer,) = answers
    assert answer.status_code == 200 and answer.json() == {"version": version + 1}


def test_one_announcement_for_the_whole_gateway_and_a_weight_change_is_one(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    gw = c.gateway
    assert gw.changes is gw.store.changes is gw.fleet.changes  # pins and lifecycles on one version
    version = changes(c.url).json()["version"]
    assert httpx.patch(c.url + "/admin/backends/a", json={"weight": 2}, timeout=10).status_code == 200
    assert changes(c.url, since=version, wait_s=0).json() == {"version": version + 1}


def test_each_pin_claimed_counts_once_and_a_turn_that_keeps_it_none(cluster: ClusterFactory) -> None:
    c = cluster(["a"], routing={"policy": "affinity"})  # a repeated first turn is one pin (ttft: twins)
    c.wait_for(lambda: c.gateway.registry.backends["a"].state.value == "ready", "a ready")
    version = changes(c.url).json()["version"]
    assert chat(c.url, "conv-1").status_code == 200  # a new conversation: its pin is claimed
    assert changes(c.url, since=version, wait_s=0).json() == {"version": version + 1}
    assert chat(c.url, "conv-1", turn=1).status_code == 200  # the same conversation: the pin is touched
    assert changes(c.url, since=version + 1, wait_s=0).json() == {"version": version + 1}


def test_a_stale_or_future_version_is_answered_at_once(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    now = changes(c.url).json()["version"]
    # Another process's version (a restart): not equal, so no wait however long asked.
    assert changes(c.url, since=now + 1000, wait_s=30).json() == {"version": now}
    assert changes(c.url, since=now, wait_s=0).json() == {"version": now}


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"wait_s": 31}, "wait_s"),
        ({"wait_s": -1}, "wait_s"),
        ({"wait_s": "nan"}, "wait_s"),
        ({"since": -1}, "since"),
        ({"since": "seven"}, "since"),
        ({"until": 3}, "until"),
    ],
)
def test_bad_queries_are_422_naming_the_parameter(
    cluster: ClusterFactory, query: dict[str, object], param: str
) -> None:
    c = cluster(["a"])
    r = changes(c.url, **query)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("validation_error", param)
