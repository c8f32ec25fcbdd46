"""Live fault switches and the admin body that changes them (``POST /sim/faults``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backends.sim.config import Faults


class FaultsPatch(BaseModel):
    """Fields present in the body are set; absent ones keep their value. ``null`` turns
    ``die_mid_stream_after`` off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    fail_next: int | None = Field(default=None, ge=0)
    die_mid_stream_after: int | None = Field(default=None, ge=0)
    stall_s: float | None = Field(default=None, ge=0)
    repeat_token: bool | None = None
    health_fail: bool | None = None
    slow_factor: float | None = Field(default=None, gt=0)


class FaultState:
    def __init__(self, initial: Faults) -> None:
        self.current = initial

    def apply(self, patch: FaultsPatch) -> Faults:
        changes: dict[str, Any] = {}
        for name in patch.model_fields_set:
            value = getattr(patch, name)
            if value is None and name != "die_mid_stream_after":
                continue
            changes[name] = value
        self.current = dataclasses.replace(self.current, **changes)
        return self.current

    def reset(self) -> Faults:
        self.current = Faults()
        return self.current

    def take_failure(self) -> bool:
        """True if this request must fail (and uses up one of ``fail_next``)."""
        if self.current.fail_next <= 0:
            return False
        self.current = dataclasses.replace(self.current, fail_next=self.current.fail_next - 1)
        return True

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.current)
