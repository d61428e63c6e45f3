"""What the decode loop hands to whatever plans its steps (``speculate="auto"``): one
:class:`StepRecord` per step, the :class:`Planner` contract, and the :class:`ModalDrafter`
capability of drafters that can draft a step in more than one way. No policy lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .tree import TreeBatch


@runtime_checkable
class ModalDrafter(Protocol):
    """A drafter that can draft a step in more than one way (e.g. EAGLE's sequential or parallel
    depths, a hybrid with or without its trained drafter), each with its own cost and acceptance.
    Checked once when a planner binds the drafter."""

    modes: tuple[str, ...]
    """The ways this drafter can draft a step."""

    fixed_modes: tuple[str, ...]
    """The modes whose trees do not change with the drafter's size
    (:class:`~tree_attention.capabilities.SizedDrafter`), e.g. a hybrid's lookup alone."""

    def use_mode(self, mode: str | None) -> None:
        """Draft the next steps in ``mode`` (one of :attr:`modes`); None: as the drafter itself chooses."""


STEP_KINDS = ("plain", "empty", "drafted")
"""How a step went: ``plain`` verified each row's root alone without asking the drafter; ``empty``
asked the drafter (or cut its trees) and verified no drafted node (in cost and effect a plain step);
``drafted`` verified at least one drafted node for some row."""


@dataclass
class StepRecord:
    """What one step of the loop did, handed to the :class:`Planner` and kept in
    :attr:`DecodeStats.steps`.

    Attributes:
        kind: one of :data:`STEP_KINDS`.
        rows: rows the step decoded.
        width: nodes verified per row (the verify forward's query length, root included).
        draft_seconds: the drafter's ``propose`` and cutting the trees (0 on a plain step).
        verify_seconds: the rest of the step: mask, target forward, acceptance, cache, commit.
        tokens: tokens committed over all rows (bonus tokens included).
        first_draft: this was the call's first ``propose`` (a drafter catching up on the prompt).
        plan_seconds: the planner's choice before the step (0 without one), in neither of the above.
    """

    kind: str
    rows: int
    width: int
    draft_seconds: float
    verify_seconds: float
    tokens: int
    first_draft: bool = False
    plan_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.plan_seconds + self.draft_seconds + self.verify_seconds


class Planner(Protocol):
    """Decides, step by step, whether the loop drafts (``speculate="auto"``); a planner that sizes
    the drafter's trees does so on the drafter itself, before it drafts, so the trees a step
    verifies are whole and never depend on what was drafted.

    The loop asks :meth:`draft` before each step and reports a :class:`StepRecord` and the accepted
    paths to :meth:`observe` after it.
    """

    def draft(self, rows: int) -> bool:
        """Whether to ask the drafter for trees this step (False: a plain decoding step)."""

    def observe(self, record: StepRecord, trees: TreeBatch | None, paths: torch.Tensor,
                lengths: torch.Tensor) -> None:
        """One finished step: its record, the verified ``trees`` (roots alone on a plain step;
        None where the loop cut a drafted step's trees to the rows' token budgets), each row's
        accepted node indices ``paths`` ``[R, L]`` (padded with the last kept node) and path
        lengths ``lengths`` ``[R]`` (root included)."""
