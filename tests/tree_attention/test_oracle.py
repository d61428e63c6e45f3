"""A drafter that knows the backbone's greedy continuation: whole paths get accepted, so cache
compaction of non-contiguous tree paths is exercised on every step."""

from __future__ import annotations

import pytest
import torch

from heads.backbone import inspect_backbone
from tests.conftest import VOCAB, build_model, greedy_reference, random_prompt
from tree_attention.decode import PerRowDrafter, speculative_generate
from tree_attention.tree import Tree, from_choices


class OracleDrafter:
    """Places the true next tokens at a random rank per depth among wrong siblings."""

    def __init__(self, reference: list[int], template, seed: int = 0) -> None:
        self.reference = reference
        self.template = template
        self.seen = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.top_k = template.max_rank + 1

    def reset(self):
        self.seen = 0

    def propose(self, features, tokens, root):
        self.seen += tokens.shape[1]
        root_position = self.seen  # index of root in the reference sequence
        assert self.reference[root_position] == root
        true_ranks = torch.randint(0, self.top_k, (self.template.max_depth,), generator=self.generator)
        tokens_out = [root]
        paths = self.template.paths
        for path in paths:
            depth = len(path)
            position = root_position + depth
            truth = self.reference[position] if position < len(self.reference) else 0
            on_true_path = all(path[i] == int(true_ranks[i]) for i in range(depth))
            tokens_out.append(truth if on_true_path else (truth + 1 + path[-1]) % VOCAB)
        return self.template.with_tokens(torch.tensor(tokens_out))


BINARY_TREE = [p for d in range(1, 4) for p in __import__("itertools").product((0, 1), repeat=d)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2", "mistral", "gpt_neox"])
def test_oracle_accepts_whole_paths_and_stays_identical(name):
    model = build_model(name, seed=3)
    target = inspect_backbone(model)
    template = from_choices(BINARY_TREE)  # depth 3, two children per node
    prompt = random_prompt(7, seed=1)
    max_new = 41
    reference = greedy_reference(model, prompt, max_new + 8)[0].tolist()
    drafter = OracleDrafter(reference, template, seed=2)
    output, stats = speculative_generate(target, PerRowDrafter([drafter]), prompt, max_new)
    assert output[0].tolist() == reference[: prompt.shape[1] + max_new]
    # every verify step accepts the full depth (3 drafts + bonus), except possibly the last
    assert all(length == 3 for length in stats.accepted_lengths[:-1])
    assert stats.mean_accepted > 3.5  # depth + 1 = 4, minus the prefill and the truncated last step
    assert stats.acceptance_by_position[0] == 1.0


def test_oracle_non_contiguous_paths_are_used():
    template = from_choices(BINARY_TREE)
    # a path through rank 1 nodes is not a prefix of the node order: keep_path must gather
    index_of = {path: i + 1 for i, path in enumerate(template.paths)}
    assert index_of[(1, 1, 1)] != 3
