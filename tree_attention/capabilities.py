"""Optional capabilities a :class:`~tree_attention.decode.Drafter` declares beyond the contract,
as ``Protocol`` s checked once with ``isinstance`` when a drafter is bound (never probed with
``getattr``)."""

from __future__ import annotations

from typing import Callable, Literal, Protocol, runtime_checkable


@runtime_checkable
class StatelessDrafter(Protocol):
    """A drafter that keeps nothing between steps (it reads each row's latest entry): a step it did
    not draft need not be replayed to it. Declared on the class as ``stateless = True``."""

    stateless: Literal[True]


@runtime_checkable
class ComposedDrafter(Protocol):
    """A drafter made of other drafters (e.g. a trained drafter plus lookup in one tree) that sets
    itself up for an acceptance rule and hands the set-up of its parts to ``bind``."""

    def bind_parts(self, rule: object, bind: Callable[[object, object], object] | None) -> object:
        """This drafter set up for ``rule``; ``bind`` (``(drafter, rule) -> drafter``, or None for
        nothing to set up) is applied to the part it was made for."""


@runtime_checkable
class SizedDrafter(Protocol):
    """A drafter whose tree size can change from one step to the next while it keeps its state
    (its own cache, its per-row text): ``speculate="auto"`` chooses the size per step, so that a
    step that verifies a small tree does not pay for drafting a large one."""

    nested: bool
    """Whether, under the acceptance rule the drafter is bound to, the tree drafted at a smaller size
    is the first nodes (node order) of the tree drafted at a larger size on the same text (under
    sampling: in distribution, with each node's acceptance depending only on the nodes before it):
    then every drafted step also shows what each smaller size would have accepted."""

    def resize(self, tree: int | None) -> None:
        """Draft the next steps' trees with ``tree`` drafted nodes (as the kind's ``set_tree`` reads
        an int; None: the configured tree)."""
