"""What one request asked of its thinking budget, resolved (gateway/budgets.py): a leaf value, read by the
dialect table, the budget step and the continuation, and by nothing that it imports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from config.settings import Effort


@dataclass(frozen=True, slots=True)
class Thinking:
    """What one request asked for, resolved against its model's configuration. Never changed per attempt:
    whether the gateway enforces it on an attempt is that attempt's ``Draft.enforced``."""

    budget: int | None  # reasoning tokens allowed; None: no cap (effort only, or nothing asked)
    effort: str | None  # the client's effort, validated
    explicit: bool  # the budget came from the client, not from an effort table or a model default

    @property
    def off(self) -> bool:
        return self.budget == 0 or self.effort == Effort.NONE


class BudgetAsk(NamedTuple):
    """What a request's own fields ask, validated, before the model's configuration applies."""

    budget: int | None  # tokens (0: no thinking); None: no cap asked
    effort: str | None
    param: str  # the field that carries the budget, for an error about it
