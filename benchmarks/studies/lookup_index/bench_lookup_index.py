"""Lookup drafter index (``heads.lookup.index``): cost and an accepted-length proxy.

Text: CPython's own stdlib sources tokenised as bytes (token = byte value). A few files form a
shared corpus (one stream each, confidence 0.8); a held-out file is the "row": at each position
``t`` its own index holds ``text[:t]``, ``propose`` drafts from it (and the corpus), and the proxy is
the longest proposed path that equals ``text[t:t + depth]`` (what greedy verification would accept,
the bonus token not counted).

1. Timings (perf_counter, per call): ``extend`` of 3 tokens on a ~2k-token stream; ``propose``
   (budget 16, max_depth 8) on a ~2k-token stream, own index alone and own + corpus;
   ``pad_proposals`` for 8 rows against an alternative that builds visibility by depth-level gathers.
2. Mean matched length for budget 1 (one token), 4 and 16 and for a chain (the greedy path of a
   budget-64 tree: what a prompt-lookup chain drafter would propose), with and without the
   shorter-match backoff.
3. Calibration: for the first selected node (the best root child), mean score against the share of
   positions where it was the true next token, by match length.

Prints tables; writes nothing. ``--positions`` bounds the held-out positions evaluated.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from heads.lookup.index import Proposal, SuffixIndex, pad_proposals, propose

CORPUS = ("argparse.py", "dataclasses.py", "enum.py", "functools.py", "textwrap.py")
HELD_OUT = "inspect.py"
DEPTH = 8
BUDGETS = (1, 4, 16)
BACKOFFS = (0.0, 0.1, 0.3)


def read_bytes(name: str) -> list[int]:
    return list((Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes())


def per_call_us(function: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds per call over ``calls`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def matched_length(proposal: Proposal, truth: Sequence[int]) -> int:
    """Length of the longest proposed path equal to a prefix of ``truth``."""
    depth_of = []  # matched depth of each node, 0 when the node's path does not match
    best = 0
    for token, parent in zip(proposal.tokens, proposal.parents):
        above = 0 if parent < 0 else depth_of[parent]
        ok = (parent < 0 or above > 0) and above < len(truth) and truth[above] == token
        depth_of.append(above + 1 if ok else 0)
        best = max(best, depth_of[-1])
    return best


def timings(corpus: SuffixIndex, text: list[int]) -> list[tuple[str, float]]:
    own = SuffixIndex()
    row = own.add_stream(text[:2000])
    chunks = [text[2000 + 3 * k:2003 + 3 * k] for k in range(200)]
    start = time.perf_counter()
    for chunk in chunks:
        own.extend(row, chunk)
    rows = [("extend 3 tokens, ~2k-token stream (us)", 1e6 * (time.perf_counter() - start) / len(chunks))]
    own.drop_stream(row)  # it holds text[2000:2600], the very continuations propose_us looks for
    for label, sources in (("own", [(own, 1.0)]), ("own+corpus", [(own, 1.0), (corpus, 0.8)])):
        rows.append((f"propose budget 16 depth 8, {label}, ~2k-token row (us)", propose_us(text, sources, own)))
    contexts = [text[:2000 + k] for k in range(0, 24, 3)]
    proposals = [propose(context, [(corpus, 0.8)], 16, DEPTH) for context in contexts]
    roots = [context[-1] for context in contexts]
    rows.append(("pad_proposals 8 rows x <= 16 nodes, bit masks (us)",
                 per_call_us(lambda: pad_proposals(roots, proposals), 200)))
    rows.append(("pad_proposals 8 rows x <= 16 nodes, level gathers (us)",
                 per_call_us(lambda: pad_by_levels(roots, proposals), 200)))
    return rows


def propose_us(text: list[int], sources: list, own: SuffixIndex, steps: int = 400) -> float:
    """Mean microseconds of ``propose`` from a fresh row stream of ``text[:2000]`` grown a token per step."""
    row = own.add_stream(text[:2000])
    seconds = []
    for t in range(2000, 2000 + steps):
        context = own.tokens(row)
        start = time.perf_counter()
        propose(context, sources, 16, DEPTH)
        seconds.append(time.perf_counter() - start)
        own.extend(row, text[t:t + 1])
    own.drop_stream(row)
    return 1e6 * statistics.mean(seconds)


def pad_by_levels(roots: Sequence[int], proposals: Sequence[Proposal]) -> dict[str, torch.Tensor]:
    """The alternative measured against ``pad_proposals``: visibility by ``max depth`` tensor gathers."""
    width = 1 + max(len(p) for p in proposals)
    parents = torch.tensor([[-1] + [q + 1 for q in p.parents] + [-1] * (width - 1 - len(p)) for p in proposals])
    tokens = torch.tensor([[r, *p.tokens] + [0] * (width - 1 - len(p)) for r, p in zip(roots, proposals)])
    nodes = torch.arange(width).expand_as(parents)
    up = torch.where(parents < 0, nodes, parents)  # roots and padding point at themselves
    visibility = torch.eye(width, dtype=torch.bool).repeat(len(proposals), 1, 1)
    depths = torch.zeros_like(parents)
    current = nodes
    for _ in range(DEPTH):
        above = up.gather(1, current)
        moved = above != current
        if not bool(moved.any()):
            break
        depths += moved.long()
        visibility.scatter_(2, above.unsqueeze(-1), True)
        current = above
    return {"tokens": tokens, "parents": parents, "depths": depths, "visibility": visibility}


def greedy_chain(proposal: Proposal) -> Proposal:
    """The path that follows each node's first-selected (= best) child from the root."""
    keep, at = [], -1
    for node, parent in enumerate(proposal.parents):
        if parent == at:
            keep.append(node)
            at = node
    return Proposal([proposal.tokens[n] for n in keep], list(range(-1, len(keep) - 1)),
                    [proposal.scores[n] for n in keep], proposal.match_length)


def accepted_proxy(text: list[int], positions: int, corpus: SuffixIndex | None, backoff: float,
                   calibration: dict | None = None) -> dict[str, tuple[float, float]]:
    """Per tree kind (budget 1, 4, 16, chain): mean matched length over positions ``1 .. positions``
    and mean propose microseconds. ``calibration`` (optional) collects, per match length,
    ``[positions, summed first-node score, first-node hits]`` of the budget-16 proposals."""
    own = SuffixIndex()
    row = own.add_stream(text[:1])
    sources = [(own, 1.0)] + ([(corpus, 0.8)] if corpus is not None else [])
    kinds = {f"budget {b}": b for b in BUDGETS} | {"chain (of budget 64)": 64}
    matched = dict.fromkeys(kinds, 0)
    seconds = dict.fromkeys(kinds, 0.0)
    end = min(len(text) - 1, positions)
    for t in range(1, end + 1):
        context = own.tokens(row)
        truth = text[t:t + DEPTH]
        for kind, budget in kinds.items():
            start = time.perf_counter()
            proposal = propose(context, sources, budget, DEPTH, backoff=backoff)
            seconds[kind] += time.perf_counter() - start
            if budget == 64:
                proposal = greedy_chain(proposal)
            matched[kind] += matched_length(proposal, truth)
            if calibration is not None and budget == 16 and proposal.tokens:
                cell = calibration.setdefault(proposal.match_length, [0, 0.0, 0])
                cell[0] += 1
                cell[1] += proposal.scores[0]
                cell[2] += proposal.tokens[0] == truth[0]
        own.extend(row, text[t:t + 1])
    return {kind: (matched[kind] / end, 1e6 * seconds[kind] / end) for kind in kinds}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=20_000, help="held-out positions evaluated")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    corpus = SuffixIndex()
    for name in CORPUS:
        corpus.add_stream(read_bytes(name))
    build_us = 1e6 * (time.perf_counter() - start) / len(corpus)
    text = read_bytes(HELD_OUT)
    print(f"corpus: {', '.join(CORPUS)} = {len(corpus)} byte tokens ({build_us:.2f} us/token to index); "
          f"held out: {HELD_OUT}, first {min(args.positions, len(text) - 1)} positions; max_depth {DEPTH}")
    for label, value in timings(corpus, text):
        print(f"  {label:<58} {value:8.1f}")
    print("\nmean matched length (tokens a greedy verifier accepts per step, bonus token excluded) | propose us/call")
    print(f"  {'sources':<12}{'tree':<22}" + "".join(f"{'backoff ' + str(b):>13}" for b in BACKOFFS)
          + " |" + "".join(f"{'us ' + str(b):>9}" for b in BACKOFFS))
    calibration: dict = {}
    for label, source in (("own", None), ("own+corpus", corpus)):
        results = [accepted_proxy(text, args.positions, source, backoff,
                                  calibration if source is not None and backoff == 0.0 else None)
                   for backoff in BACKOFFS]
        for kind in results[0]:
            print(f"  {label:<12}{kind:<22}" + "".join(f"{r[kind][0]:>13.3f}" for r in results)
                  + " |" + "".join(f"{r[kind][1]:>9.1f}" for r in results))
    print("\ncalibration, own+corpus, budget 16, no backoff: first node's score vs its hit rate")
    print(f"  {'match length':>12}{'positions':>10}{'mean score':>12}{'hit rate':>10}")
    for length in sorted(calibration):
        count, score, hits = calibration[length]
        print(f"  {length:>12}{count:>10}{score / count:>12.3f}{hits / count:>10.3f}")


if __name__ == "__main__":
    main()
