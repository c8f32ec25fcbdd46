"""What the admin plane is handed: exactly the parts of the gateway it reads or changes, nothing more.

``create_app`` builds one ``AdminPorts`` from what it wired; the admin never sees the gateway as a whole,
so it imports neither ``gateway.app`` nor any concrete store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from backends.changes import Changes
from backends.fleet import Fleet
from backends.health import HealthChecker
from backends.registry import Registry
from config.settings import AdminConfig, CanaryConfig
from gateway.admission import AdmissionControl
from gateway.endpoints import Endpoint
from gateway.learning import RoutingFeedback
from gateway.metrics import Metrics
from gateway.quotas import Quotas
from gateway.state import AffinityStore
from gateway.upstream import UpstreamPool


@dataclass(frozen=True, slots=True)
class AdminPorts:
    registry: Registry
    fleet: Fleet
    health: HealthChecker  # a backend added at runtime is probed, a removed one no more
    store: AffinityStore
    metrics: Metrics
    transport: UpstreamPool  # a removed backend's pooled connections are closed
    client: httpx.AsyncClient  # engine /metrics scrapes and out-of-band canaries
    changes: Changes  # GET /admin/changes waits on it
    admin: AdminConfig
    canary: CanaryConfig
    policy: str  # the configured routing policy's name, for the explain reply
    endpoints: Mapping[str, Endpoint]  # path -> the endpoint serving it (the explain dry run)
    feedback: RoutingFeedback | None = None  # the ttft policy's inputs, when it is configured
    admission: AdmissionControl | None = None  # admission per backend, when it is enabled
    quotas: Quotas | None = None  # quotas per client key, when a key has one
