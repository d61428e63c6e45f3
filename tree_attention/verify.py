"""Acceptance rules: which path of a verified tree the target keeps.

Greedy (lossless for ``do_sample=False``): a node is correct when its token equals the target's
argmax at its parent; the longest path of correct nodes from the root is accepted and the
target's argmax at the path's last node is the bonus token. Every token committed is therefore
the target's own greedy choice given the tokens before it: output is identical to plain greedy
decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree

ACCEPTANCE_RULES = ("greedy",)


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one tree.

    Attributes:
        path: ``[k]`` long node indices from the root (index 0) down, increasing.
        next_token: the bonus token the target produces after the path's last node.
    """

    path: torch.Tensor
    next_token: int

    @property
    def accepted_drafts(self) -> int:
        """Drafted nodes accepted (the root was committed before this step)."""
        return int(self.path.numel()) - 1


def deepest_path(tree: Tree, correct: torch.Tensor) -> torch.Tensor:
    """Longest root path whose nodes are all ``correct`` (``[N]`` bool; the root counts as correct).

    Ties between equally deep nodes go to the lower index. Returns ``[k]`` node indices.
    """
    correct = correct.clone()
    correct[0] = True
    alive = ~(tree.ancestors & ~correct.unsqueeze(0)).any(dim=-1)  # (N,) every ancestor correct
    score = torch.where(alive, tree.depths, torch.full_like(tree.depths, -1))
    best = int(torch.argmax(score))  # first maximum: lowest index among the deepest
    return torch.nonzero(tree.ancestors[best], as_tuple=False).flatten()


def greedy_accept(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance. ``logits`` is ``[N, V]``: the target's logits at every tree node."""
    if logits.dim() != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [N={tree.size}, V]; got shape {tuple(logits.shape)}")
    target = logits.argmax(dim=-1)  # (N,)
    parent_choice = target[tree.parents.clamp(min=0)]
    path = deepest_path(tree, tree.tokens == parent_choice)
    return Acceptance(path=path, next_token=int(target[path[-1]]))
