"""``/admin/status``: one server-rendered HTML page an operator reads at a glance, refreshing itself.

No script, no build step, nothing from a CDN: the page is one string with its CSS inline, and a strict
Content-Security-Policy says so to the browser (no script may run even if escaping were ever missed). Every
value that comes from configuration or an engine (ids, reasons, canary answers, exit causes) goes through
``html.escape``. Auth is the admin prefix's business, not this module's.

Data: ``StatusPage`` is handed what it reads (the registry, the fleet's lifecycle controllers, the store,
the metrics' tallies); its ``snapshot`` turns them into plain values; ``render`` turns those into HTML and
does nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse

from backends.fleet import Fleet
from backends.registry import Registry
from gateway.metrics import LifecycleNote, Metrics
from gateway.state import AffinityStore
from routing.types import Reason

REFRESH_S = 5
NOTES_SHOWN = 10
REASON_CHARS = 400  # an engine's reason can hold its last output lines: enough to read, not a wall
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2330;background:#f6f7f9}
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1.4em 0 .4em}
.meta{color:#5b6475}.tiles{display:flex;gap:1em;flex-wrap:wrap;margin:1em 0}
.tile{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:.6em 1em;min-width:9em}
.tile b{display:block;font-size:22px}
table{border-collapse:collapse;width:100%;background:#fff;border:1px solid #dde1e8}
th,td{text-align:left;padding:.4em .6em;border-bottom:1px solid #eceff3;vertical-align:top}
th{background:#eef1f5;font-weight:600}
.state{display:inline-block;padding:.05em .5em;border-radius:4px;font-weight:600;color:#fff;
  background:#7a8394}
.s-ready{background:#1f8a4c}.s-canary,.s-starting{background:#b7791f}.s-down{background:#c53030}
.s-draining,.s-cordoned{background:#4a5568}
.load{white-space:nowrap}.bar{width:10em;height:.8em;background:#e6e9ef;border-radius:3px;overflow:hidden;display:inline-block}
.bar span{display:block;height:100%;background:#3b6fd8}
.reason{color:#3d4555;max-width:38em;word-break:break-word}.bad{color:#c53030}.ok{color:#1f8a4c}
"""


@dataclass(frozen=True, slots=True)
class BackendRow:
    id: str
    state: str
    reason: str
    models: tuple[str, ...]
    weight: float
    in_flight: int
    conversations: int
    circuit: str
    canary: str  # "passed", "failed: <check>", "never run"
    restarts: str  # "2 of 5 in 600 s" for managed engines, "" otherwise


@dataclass(frozen=True, slots=True)
class StatusData:
    backends: tuple[BackendRow, ...]
    load_scale: int  # the in-flight count a full bar stands for
    hit_rate: float | None
    decisions: dict[str, int]
    requests: int
    shared_state: str
    degraded: bool
    notes: tuple[LifecycleNote, ...]  # newest first
    now: float
    admission: AdmissionRows | None = None  # None: admission is off
    quotas: tuple[tuple[str, int, int, int], ...] | None = (
        None  # key, admitted, refused, unchecked; None: off
    )


@dataclass(frozen=True, slots=True)
class AdmissionRows:
    waiting: tuple[tuple[str, int], ...]  # per class, highest first
    clients: tuple[tuple[str, int, int], ...]  # key name, admitted, refused (queue full or timed out)


class StatusPage:
    """``page`` is the ``GET /admin/status`` endpoint. ``load_floor``: the in-flight count a full load
    bar stands for at least (``routing.spill_min_in_flight``)."""

    def __init__(
        self, registry: Registry, fleet: Fleet, store: AffinityStore, metrics: Metrics, load_floor: int
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.store = store
        self.metrics = metrics
        self.load_floor = load_floor

    async def page(self, _request: Request) -> HTMLResponse:
        conversations = (await self.store.view(None)).conversations
        html = render(self.snapshot(conversations))
        headers = {"cache-control": "no-store", "content-security-policy": CSP}
        return HTMLResponse(html, headers=headers)

    def snapshot(self, conversations: Mapping[str, int]) -> StatusData:
        status = self.fleet.status()
        rows = [self._row(b.id, status.get(b.id, {}), conversations) for b in self.registry.backends.values()]
        tally = self.metrics.tally
        shared = self.store.status()
        return StatusData(
            backends=tuple(rows),
            load_scale=max([self.load_floor, *(r.in_flight for r in rows)]),
            hit_rate=self.metrics.affinity_hit_rate(),
            decisions={reason.value: n for reason, n in tally.decisions.items() if n},
            requests=sum(tally.requests.values()),
            shared_state=str(shared.get("backend", "")),
            degraded=bool(shared.get("degraded")),
            notes=tuple(reversed(self.metrics.fleet.recent))[:NOTES_SHOWN],
            now=time.time(),
            admission=self._admission(),
            quotas=self._quotas(),
        )

    def _quotas(self) -> tuple[tuple[str, int, int, int], ...] | None:
        """This replica's quota counts per key (its own counters: no round trip to shared state)."""
        m = self.metrics.quota
        if m is None:
            return None
        counts: dict[str, list[int]] = {}
        for (client, outcome), n in list(m.clients.items()):
            row = counts.setdefault(client, [0, 0, 0])
            row[0 if outcome == "admitted" else 2 if outcome == "unchecked" else 1] += n
        return tuple((name, a, r, u) for name, (a, r, u) in sorted(counts.items()))

    def _admission(self) -> AdmissionRows | None:
        m = self.metrics.admission
        if m is None:
            return None
        counts: dict[str, list[int]] = {}
        for (client, outcome), n in list(m.clients.items()):
            row = counts.setdefault(client, [0, 0])
            if outcome == "admitted":
                row[0] += n
            elif outcome != "left":
                row[1] += n
        clients = tuple((name, a, r) for name, (a, r) in sorted(counts.items()))
        return AdmissionRows(tuple(m.depths.items()), clients)

    def _row(self, backend_id: str, st: dict[str, Any], conversations: Mapping[str, int]) -> BackendRow:
        b = self.registry.backends[backend_id]
        return BackendRow(
            id=b.id,
            state=str(st.get("state", b.state.value)),
            reason=str(st.get("reason") or ""),
            models=tuple(b.cfg.models),
            weight=b.cfg.weight,
            in_flight=b.in_flight,
            conversations=int(conversations.get(b.id, 0)),
            circuit=str(st.get("circuit", "")),
            canary=_canary(st.get("canary")),
            restarts=_restarts(st.get("managed")),
        )


def _canary(canary: dict[str, Any] | None) -> str:
    if not canary:
        return "never run"
    if canary.get("passed"):
        return "passed"
    return f"failed: {canary.get('check_name') or 'no check ran'}"


def _restarts(managed: dict[str, Any] | None) -> str:
    if not managed:
        return ""
    text = f"{managed['restarts_in_window']} of {managed['max_restarts']} in {managed['window_s']:g} s"
    return text + (", gave up" if managed.get("gave_up") else "")


# -- rendering --------------------------------------------------------------------------------------------


def render(data: StatusData) -> str:
    ready = sum(1 for r in data.backends if r.state == "ready")
    hit = "-" if data.hit_rate is None else f"{data.hit_rate:.0%}"
    store = escape(data.shared_state) + (" <span class=bad>(degraded)</span>" if data.degraded else "")
    tiles = "".join(
        f'<div class=tile id="{tid}"><b>{value}</b>{label}</div>'
        for tid, value, label in (
            ("t-ready", f"{ready}/{len(data.backends)}", "backends ready"),
            ("t-hit", hit, "affinity hit rate"),
            ("t-requests", str(data.requests), "requests"),
            ("t-store", store, "shared state"),
        )
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data.now))
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        '<link rel="icon" href="data:,"><title>warmroute status</title>'
        f"<style>{_CSS}</style></head><body>"
        f"<h1>warmroute</h1><div class=meta>as of {stamp}; refreshes every {REFRESH_S} s</div>"
        f"<div class=tiles>{tiles}</div>"
        f"<h2>Backends</h2>{_backends(data)}"
        f"<h2>Routing decisions</h2>{_decisions(data.decisions)}"
        f"{_admission(data.admission)}"
        f"{_quotas(data.quotas)}"
        f"<h2>Recent restarts and canary failures</h2>{_notes(data.notes)}"
        "</body></html>"
    )


def _backends(data: StatusData) -> str:
    head = (
        "<tr><th>backend</th><th>state</th><th>load (in flight)</th><th>pinned</th><th>canary</th>"
        "<th>restarts</th><th>models</th><th>reason</th></tr>"
    )
    return f"<table id=backends>{head}{''.join(_row(r, data.load_scale) for r in data.backends)}</table>"


def _row(r: BackendRow, scale: int) -> str:
    width = min(100, round(100 * r.in_flight / scale)) if scale else 0
    state = escape(r.state)
    circuit = "" if r.circuit in ("", "closed") else f" <span class=bad>circuit {escape(r.circuit)}</span>"
    canary_cls = "ok" if r.canary == "passed" else "bad" if r.canary.startswith("failed") else "meta"
    reason = r.reason if len(r.reason) <= REASON_CHARS else r.reason[:REASON_CHARS] + "…"
    return (
        f'<tr class=backend data-backend="{escape(r.id)}" data-state="{state}">'
        f"<td><b>{escape(r.id)}</b><br><span class=meta>weight {r.weight:g}</span></td>"
        f'<td><span class="state s-{state}">{state}</span>{circuit}</td>'
        f'<td class=load><span class=bar><span style="width:{width}%"></span></span> {r.in_flight}'
        f" <span class=meta>of {scale}</span></td>"
        f"<td>{r.conversations}</td>"
        f"<td class={canary_cls}>{escape(r.canary)}</td>"
        f"<td>{escape(r.restarts) or '-'}</td>"
        f"<td>{escape(', '.join(r.models))}</td>"
        f"<td class=reason>{escape(reason)}</td></tr>"
    )


def _decisions(decisions: dict[str, int]) -> str:
    if not decisions:
        return "<p class=meta>no routing decisions yet</p>"
    total = sum(decisions.values())
    order = [r.value for r in Reason]
    rows = "".join(
        f"<tr><td>{escape(name)}</td><td>{n}</td><td>{n / total:.0%}</td></tr>"
        for name, n in sorted(decisions.items(), key=lambda kv: order.index(kv[0]))
    )
    return f"<table id=decisions><tr><th>reason</th><th>decisions</th><th>share</th></tr>{rows}</table>"


def _admission(a: AdmissionRows | None) -> str:
    if a is None:
        return ""
    waiting = "".join(f"<tr><td>{escape(name)}</td><td>{n}</td></tr>" for name, n in a.waiting)
    clients = "".join(
        f"<tr><td>{escape(name) or '<span class=meta>(no key)</span>'}</td><td>{ok}</td><td>{bad}</td></tr>"
        for name, ok, bad in a.clients
    )
    return (
        f"<h2>Admission</h2><table id=admission><tr><th>class</th><th>waiting</th></tr>{waiting}</table>"
        "<table id=admission-keys><tr><th>client key</th><th>admitted</th><th>refused</th></tr>"
        f"{clients}</table>"
    )


def _quotas(rows: tuple[tuple[str, int, int, int], ...] | None) -> str:
    if rows is None:
        return ""
    body = "".join(
        f"<tr><td>{escape(name)}</td><td>{ok}</td><td>{bad}</td><td>{unchecked}</td></tr>"
        for name, ok, bad, unchecked in rows
    )
    return (
        "<h2>Quotas</h2><table id=quotas><tr><th>client key</th><th>admitted</th><th>refused (429)</th>"
        f"<th>unchecked</th></tr>{body or '<tr><td colspan=4 class=meta>no requests yet</td></tr>'}</table>"
    )


def _notes(notes: tuple[LifecycleNote, ...]) -> str:
    if not notes:
        return "<p class=meta id=notes>none since the gateway started</p>"
    rows = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.gmtime(n.at))}</td><td>{escape(n.backend)}</td>"
        f"<td class=bad>{escape(n.kind.replace('_', ' '))}</td><td>{escape(n.label)}</td>"
        f"<td class=reason>{escape(n.detail[:REASON_CHARS])}</td></tr>"
        for n in notes
    )
    return (
        "<table id=notes><tr><th>time (UTC)</th><th>backend</th><th>what</th><th>cause / check</th>"
        f"<th>detail</th></tr>{rows}</table>"
    )
