"""Everything decided while serving, from one cost curve and one calibrated acceptance model:
``speculate="auto"`` (:class:`Adaptive`, one :class:`CallPlanner` per call)."""

from __future__ import annotations

from .acceptance import AcceptanceModel
from .cost import CostCurve
from .planner import Adaptive, CallPlanner, CallSummary, Choice

__all__ = ["AcceptanceModel", "Adaptive", "CallPlanner", "CallSummary", "Choice", "CostCurve"]

