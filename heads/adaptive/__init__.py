"""Everything decided while serving, from one cost curve and one calibrated acceptance model:
``speculate="auto"`` (:class:`Adaptive`, one :class:`CallPlanner` per call)."""

from __future__ import annotations

from typing import Mapping

from .acceptance import AcceptanceModel
from .cost import CostCurve
from .planner import Adaptive, CallPlanner, CallSummary, Choice

__all__ = ["AcceptanceModel", "Adaptive", "CallPlanner", "CallSummary", "Choice", "CostCurve", "recorded_acceptance"]


def recorded_acceptance(acceptance: Mapping, sampled: bool = False) -> list[float]:
    """The mean acceptance by depth over the traffic mixes an adapter recorded at save time
    (``adapter_config.json``'s ``acceptance``: ``{mix: {"acceptance_by_position": [...],
    "temperature": T}}``), over the entries recorded greedy (no temperature, or 0) or, ``sampled``,
    at a temperature: acceptance under one says little of the other."""
    rows = [row for entry in acceptance.values() if isinstance(entry, Mapping)
            and (float(entry.get("temperature") or 0) > 0) == sampled and (row := entry.get("acceptance_by_position"))]
    if not rows:
        return []
    depth = max(len(row) for row in rows)
    return [sum(row[index] for row in rows if index < len(row)) / sum(1 for row in rows if index < len(row))
            for index in range(depth)]
