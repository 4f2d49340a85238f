"""One broken layout rule, as the planner reads it (`key`) and users read it (the message). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One broken layout rule. Callers that decide by rule (the planner) read `key`; users read the
    message (`str(problem)`), one line naming the key, its value and what is allowed."""

    key: str  # the config key to change, e.g. "parallel.tp"
    value: object
    allowed: str
    message: str

    def __str__(self) -> str:
        return self.message
