"""``SpeculativeModel``: a frozen backbone plus a drafter, with a ``generate`` that returns exactly
what the backbone's own ``generate`` returns."""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from tree_attention.capabilities import ComposedDrafter
from tree_attention.decode import DecodeStats, SpeculativeDecoder
from tree_attention.tree import TreeTemplate

from . import kinds
from .adapter import recorded_acceptance
from .adaptive import Adaptive
from .backbone import Backbone
from .families import position_limit
from .generation import acceptance_rule, resolve_generation
from .processors import context_processors, custom_processors


logger = logging.getLogger(__name__)


def eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """The eos ids of ``model.generation_config`` (int, list or tensor) as a set."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return frozenset([eos] if isinstance(eos, int) else [int(token) for token in eos])


@contextmanager
def _evaluation(module: nn.Module):
    """Eval mode inside the block, the previous mode after (no recursion when already in eval)."""
    was_training = module.training
    if was_training:
        module.eval()
    try:
        yield
    finally:
        if was_training:
            module.train()


def _one_call_at_a_time(method):
    """``method`` run under its spec's lock (``_lock``, re-entrant): a drafter keeps per-call state
    (rows, caches, history), so two calls on one spec must not interleave."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def pad_token_id(model: PreTrainedModel) -> int | None:
    """The id ``generate`` pads finished rows with: ``pad_token_id``, else the first eos id."""
    config = model.generation_config
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    if isinstance(eos, (list, tuple)):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def check_generate_inputs(input_ids, attention_mask, max_new_tokens) -> None:
    """Reject what ``generate`` cannot serve, naming the argument."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor; got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length]; got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise TypeError(f"input_ids must hold integer token ids; got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: give at least one prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; got {shape}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        mask = attention_mask.long()
        empty = torch.nonzero(mask.sum(dim=1) == 0).flatten().tolist()
        if empty:
            raise ValueError(f"attention_mask: rows {empty} are all padding; every row needs a prompt token")
        # left padding: once a row's tokens start, no padding follows (the mask never falls from 1 to 0)
        wrong = torch.nonzero((mask[:, 1:] < mask[:, :-1]).any(dim=1)).flatten().tolist()
        if wrong:
            raise ValueError(
                f"attention_mask: rows {wrong} have padding after their tokens (right padding or holes); a "
                "decoder-only model continues from the last column, so pad on the left "
                "(tokenizer.padding_side = 'left')"
            )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int; got {max_new_tokens!r}")


def infer_attention_mask(model: PreTrainedModel, input_ids: torch.Tensor, settings=None) -> torch.Tensor:
    """The mask ``generate`` assumes when none is given: pad tokens hidden when the pad id is set,
    occurs in the input and differs from eos; otherwise every token visible."""
    config = model.generation_config if settings is None else settings.config
    pad = config.pad_token_id
    eos = eos_token_ids(model) if settings is None else settings.eos_token_ids
    if pad is not None and int(pad) not in eos and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


def stopping(criteria, config, input_ids: torch.Tensor):
    """A ``(row, new tokens) -> stop?`` check from transformers stopping criteria (and
    ``config.max_time``), evaluated on the row's whole sequence as ``generate`` does; None when
    there is nothing to check."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

    checks = StoppingCriteriaList(list(criteria or []))
    if getattr(config, "max_time", None) is not None:
        checks.append(MaxTimeCriteria(max_time=config.max_time))
    if not checks:
        return None
    prompts = input_ids.cpu()

    def stop(row: int, output: list[int]) -> bool:
        sequence = torch.cat([prompts[row], torch.tensor(output, dtype=prompts.dtype)])[None]
        return bool(torch.as_tensor(checks(sequence, None)).any())

    return stop


@dataclass(frozen=True)
class ServedCall:
    """One finished ``generate`` call, as an online learner (``spec.learning``) receives it."""

    input_ids: torch.Tensor
    """``[B, T]`` the prompts, left-padded."""
    attention_mask: torch.Tensor
    """``[B, T]`` 1 at prompt tokens."""
    output: torch.Tensor
    """``[B, T + new]`` what ``generate`` returned (finished rows padded)."""
    eos_token_ids: frozenset[int]
    stats: DecodeStats
    seconds: float
    """Wall-clock seconds of the whole call."""
    greedy: bool
    """Greedy decoding (the output is the target's own argmax continuation)."""

    def sequences(self) -> list[torch.Tensor]:
        """Each row's whole sequence ``[L]`` on the CPU: its prompt tokens (padding dropped), then what it
        generated up to and including its first eos (without eos ids: every generated column; a row
        cut by a stopping criterion keeps its padding, which a distillation loss scores as any other
        context)."""
        prompt_width = self.input_ids.shape[1]
        generated = self.output[:, prompt_width:].cpu()
        rows = []
        for prompt, mask, new in zip(self.input_ids.cpu(), self.attention_mask.cpu().bool(), generated):
            if self.eos_token_ids:
                ends = torch.isin(new, torch.tensor(sorted(self.eos_token_ids))).nonzero().flatten()
                new = new[: int(ends[0]) + 1] if ends.numel() else new
            rows.append(torch.cat([prompt[mask], new]))
        return rows


class Learner(Protocol):
    """What ``spec.learning`` holds (``training.online.OnlineLearner``): an object that sees every
    finished ``generate`` call and may change the drafter's weights before the call returns (never the
    backbone's), and what :meth:`SpeculativeModel.save_pretrained` records of what it did."""

    def observe(self, call: ServedCall) -> None: ...

    def adapter_metadata(self) -> dict:
        """``save_pretrained`` metadata (``training``, ``acceptance``) describing the learned drafter
        ({} when nothing was learned)."""
        ...


def check_learner_settings(settings) -> None:
    """TypeError unless ``settings`` can start a learner (an object with ``attach(spec)``, such as
    ``training.online.OnlineConfig``) or is None / False (no learning)."""
    if settings is None or settings is False or callable(getattr(settings, "attach", None)):
        return
    raise TypeError(f"learn= takes the learner's settings, e.g. training.online.OnlineConfig(budget=0.05) "
                    f"(heads does not import training), or None / False; got {settings!r}")


class SpeculativeModel:
    """A frozen causal LM (``backbone``) that drafts for itself with ``heads``.

    Attributes:
        backbone: the unmodified ``PreTrainedModel`` (frozen).
        heads: the drafter, the only trainable parameters.
        target: the :class:`~heads.backbone.Backbone` view of ``backbone`` the loop runs.
        last_stats: :class:`~tree_attention.decode.DecodeStats` of the calling thread's last
            ``generate`` (a thread that has not called it reads the last call's of any thread).
        backbone_lora: the backbone's peft adapters (:class:`heads.lora.BackboneLora`) or None.
    """

    def __init__(self, target: Backbone, heads: nn.Module, kind: str, config,
                 accuracy: Sequence[Sequence[float]] | None = None) -> None:
        self._lock = threading.RLock()  # held by generate, set_tree and set_lookup
        self._thread_stats = threading.local()
        self._latest_stats: DecodeStats | None = None
        self.target = target
        self.backbone = target.model
        self.heads = heads
        self.kind = kind
        self.config = config
        self.accuracy = [list(row) for row in accuracy] if accuracy is not None else None
        self.metadata: dict = {}
        self.backbone_lora = None
        """:class:`heads.lora.BackboneLora` when the backbone carries peft adapters (a Medusa-2 LoRA, a
        ``PeftModel``): its outputs then differ from the base model's, and the adapter pins both."""
        self._policy = None
        self.lookup = None
        """The settings of the lookup drafting added to this drafter's trees (:meth:`set_lookup`), or None."""
        self._hybrid = None  # what the hybrid drafters share (the registry's ``DrafterKind.hybrid``), or None
        self.learning: Learner | None = None
        """The online learner every ``generate`` call feeds before it returns (:meth:`learn`), or
        None. It changes only the drafter's weights: outputs stay what the backbone generates."""
        self.tree_choice = None
        """The tree last given to :meth:`set_tree` (None: the configured one)."""
        self.set_tree(config.tree)

    @property
    def last_stats(self) -> DecodeStats | None:
        """The calling thread's last ``generate`` statistics; in a thread that has not called
        ``generate`` (e.g. the one that started a streaming call), the latest of any thread."""
        return getattr(self._thread_stats, "value", self._latest_stats)

    @last_stats.setter
    def last_stats(self, stats: DecodeStats | None) -> None:
        self._thread_stats.value = self._latest_stats = stats

    @property
    def tree(self) -> TreeTemplate:
        """The static tree template (kinds that fill one fixed tree; others grow a tree per step,
        see ``config``)."""
        if not kinds.get(self.kind).static_tree:
            raise AttributeError(f"a {self.kind} drafter has no static tree; its tree shape is in spec.config")
        return self._drafter.template

    @property
    def drafter(self):
        """The object that proposes one tree per step (``tree_attention.decode.Drafter``)."""
        return self._drafter

    def shared_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)

    @_one_call_at_a_time
    def set_tree(self, tree=None) -> None:
        """Choose the verification tree (None: the configured one).

        Medusa: a choice list or a default tree of ``tree`` drafted nodes, built from the accuracies
        measured for these heads when known. EAGLE: a dynamic tree of ``tree`` drafted nodes
        (``total_tokens``), or a mapping of ``depth``/``top_k``/``total_tokens`` overrides.
        """
        self._drafter = self.drafter_for(tree)
        self.tree_choice = tree

    def locked(self):
        """The spec's lock (re-entrant), held by every ``generate`` call: hold it to change the drafter
        between calls from another thread (e.g. an online learner's step)."""
        return self._lock

    def drafter_for(self, tree=None):
        """A drafter for another tree (as :meth:`set_tree` takes it), leaving this spec's own unchanged."""
        drafter = kinds.get(self.kind).build_drafter(self, tree)
        return drafter if self._hybrid is None else self._hybrid.wrap(drafter)

    @_one_call_at_a_time
    def set_lookup(self, lookup=True, **options) -> None:
        """Add lookup drafting to this drafter's trees (a hybrid; ``False``/None: remove it).

        ``lookup``: True (default lookup settings), a :class:`heads.lookup.LookupConfig`, or
        options as ``attach_heads(kind="lookup", ...)`` takes them (``budget``/``tree``, ``corpus``, ...).
        Outputs are unchanged (lossless); each step's tree grows by at most the lookup budget where
        the text repeats itself.
        """
        if lookup is None or lookup is False:
            self.lookup = self._hybrid = None
        else:
            entry = kinds.hybrid()
            config = lookup if isinstance(lookup, entry.config_class) else entry.make_config(
                **(dict(lookup) if isinstance(lookup, dict) else {}), **options)
            self.lookup, self._hybrid = config, entry.hybrid(config)
        self._policy = None
        self.set_tree(None)

    @property
    def pad_token_id(self) -> int | None:
        return pad_token_id(self.backbone)

    @_one_call_at_a_time
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config=None, stopping_criteria=None, streamer=None, *,
                 inputs: torch.Tensor | None = None, logits_processor=None, prefix_allowed_tokens_fn=None,
                 generator: torch.Generator | None = None, acceptance: str = "auto",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                 speculate: str | None = None, seed: int | Sequence[int] | None = None, **kwargs) -> torch.Tensor:
        """Speculative generation; ``[B, prompt + new]`` ids, what ``backbone.generate`` returns.

        Takes what ``model.generate`` takes: ``input_ids`` ``[B, T]`` (left-padded, with
        ``attention_mask`` zeros first, as ``generate`` takes them; ``**tokenizer(texts,
        return_tensors="pt", padding=True)`` works), a ``generation_config`` (default: the
        backbone's) and any of its fields as keywords (``max_new_tokens``, ``max_length``,
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``,
        ``max_time``, ...), resolved exactly as ``generate`` resolves them (unset ``max_new_tokens``
        → ``max_length``, 20 by default). ``repetition_penalty``, ``no_repeat_ngram_size``,
        ``min_length``/``min_new_tokens`` and ``suppress_tokens``/``begin_suppress_tokens`` process
        every tree node's logits with that node's sequence (:mod:`heads.processors`). A field whose
        effect speculative decoding does not reproduce (beam search, forced tokens, ...) is refused by
        name (:data:`heads.generation.NEUTRAL`), an unknown keyword is a TypeError.
        ``stopping_criteria`` (a transformers ``StoppingCriteriaList`` or list) is checked after
        every committed token and the output is cut where ``generate`` would cut it; ``streamer``
        (``TextStreamer``, ``TextIteratorStreamer``; batch 1) receives the prompt, then each
        accepted chunk as it is committed, then ``end()``.

        Each row drafts, accepts and stops on its own; rows that end early are filled with the pad
        id (``pad_token_id``, else the first eos id). ``do_sample=False``: token-identical to
        ``backbone.generate(do_sample=False)``. ``do_sample=True``: lossless speculative sampling
        following the distribution of ``backbone.generate(do_sample=True, ...)`` at the same
        settings, its draws from ``generator`` (or torch's global RNG): reproducible only with the
        same drafter in the same state (lookup's history changes the drafts, the drafts which numbers
        are drawn). ``seed`` (an int, or one per row) samples by Gumbel-max from a counter-based
        stream instead (:mod:`tree_attention.gumbel`): the output is a function of the prompt, the
        settings and the seed alone, whatever drafts, whatever tree, wherever the row sits in a batch
        (two rows with one prompt and one seed give the same text). ``acceptance="typical"``
        selects Medusa's typical acceptance (``posterior_threshold``/``posterior_alpha``): faster,
        **lossy**. ``speculate="auto"``: each step verifies the cut of the drafter's tree (none: a
        plain decoding step) with the most expected tokens per second, from verify costs measured
        on this machine while serving and the drafter's calibrated acceptance (:mod:`heads.adaptive`);
        what it chose is in ``last_stats.speculation``. None: the configured tree, whole.

        ``inputs=`` is another name for ``input_ids`` (as in ``model.generate``; give one).
        ``logits_processor=``: a ``LogitsProcessorList`` of the processors that the fields above
        build (no-repeat n-grams, suppressed tokens, minimum lengths) is honoured as those fields,
        taking precedence over them as in ``generate``; any other processor is refused by name.
        ``prefix_allowed_tokens_fn`` is refused (it would have to run on every drafted node).

        Threads: calls on one spec run one at a time (a per-spec lock around the whole call, since
        the drafter keeps per-call state); ``last_stats`` is the calling thread's own.
        """
        started = time.perf_counter()
        if inputs is not None:
            if input_ids is not None:
                raise ValueError("generate() got the prompt twice, as input_ids and as inputs=; give one")
            input_ids = inputs
        if input_ids is None:
            raise TypeError("generate() needs input_ids (speculative decoding continues a prompt)")
        if prefix_allowed_tokens_fn is not None:
            raise NotImplementedError("prefix_allowed_tokens_fn=: speculative decoding does not constrain drafted "
                                      "nodes with it (a Python call per node); use model.generate")
        check_generate_inputs(input_ids, attention_mask, 0)
        if speculate not in (None, "auto"):
            raise ValueError(f"speculate must be None (the configured tree) or 'auto'; got {speculate!r}")
        settings = resolve_generation(self.backbone.generation_config, generation_config, kwargs,
                                      int(input_ids.shape[1]))
        config = settings.config
        limit = position_limit(self.target)
        if limit is not None and input_ids.shape[1] + settings.max_new_tokens > limit:
            raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({settings.max_new_tokens}) "
                             f"exceeds this model's {limit} positions (n_positions / max_position_embeddings)")
        rule = acceptance_rule(config, bool(config.do_sample), config.temperature, config.top_k, config.top_p,
                               generator, acceptance, posterior_threshold, posterior_alpha, seed)
        custom_processors(logits_processor, config, settings.eos_token_ids, int(input_ids.shape[1]))
        process = context_processors(config, settings.eos_token_ids, int(input_ids.shape[1]))
        if process is not None:
            rule.key = f"{rule.key} {process.key}"
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError(f"streamer= streams one sequence (batch 1, as in transformers); got a batch of "
                             f"{input_ids.shape[0]}")
        input_ids = input_ids.to(self.target.device).long()
        if attention_mask is None:
            attention_mask = infer_attention_mask(self.backbone, input_ids, settings)
        attention_mask = attention_mask.to(input_ids.device).long()
        rule = rule.for_prompts(input_ids, attention_mask)  # a seeded rule keys its draws by prompt
        criteria = stopping(stopping_criteria, config, input_ids)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        with _evaluation(self.backbone), _evaluation(self.heads):
            drafter = self._bind(self._drafter, rule)
            planner = self.adaptive.planner(rule.key, rule.deterministic, drafter) if speculate == "auto" else None
            decoder = SpeculativeDecoder(self.target, drafter, input_ids, settings.max_new_tokens,
                                         settings.eos_token_ids, rule, attention_mask, settings.pad_token_id,
                                         stop=criteria, on_commit=None if streamer is None else
                                         (lambda row, tokens: streamer.put(torch.tensor(tokens))), process=process,
                                         planner=planner)
            try:
                output, stats = decoder.run()
            finally:
                if planner is not None:
                    planner.release()
        if streamer is not None:
            streamer.end()
        if planner is not None:
            stats.speculation = functools.partial(planner.summary.as_dict, self.adaptive, rule.key)
        self.last_stats = stats
        if self.learning is not None:  # after the output is final: learning changes later calls' drafts only
            self.learning.observe(ServedCall(input_ids, attention_mask, output, settings.eos_token_ids, stats,
                                             time.perf_counter() - started, not config.do_sample))
        return output

    def _bind(self, drafter, rule):
        """The drafter set up for ``rule`` by its kind (``DrafterKind.bind_rule``), if the kind has a hook;
        a drafter made of others (a hybrid) sets itself up and hands the hook to the kind's part."""
        bind = kinds.get(self.kind).bind_rule
        if isinstance(drafter, ComposedDrafter):
            return drafter.bind_parts(rule, bind)
        return drafter if bind is None else bind(drafter, rule)

    @property
    def adaptive(self) -> Adaptive:
        """What ``speculate="auto"`` has learned on this spec (:class:`heads.adaptive.Adaptive`: the
        cost curve and the calibrated acceptance per sampling setting), kept across calls; seeded
        with the acceptance by depth the adapter recorded at save time."""
        if self._policy is None:
            declared = set(kinds.get(self.kind).policy_sizes(self))  # drafted nodes a step may be resized to
            sizes = declared if len(declared) == 1 else {1, *declared}  # (one: the drafter sizes its trees)
            extra = 0 if self.lookup is None else self.lookup.budget
            recorded = self.metadata.get("acceptance", {})
            self._policy = Adaptive(recorded_acceptance(recorded), 1 + max(sizes) + extra, sizes, extra,
                                    sampled_prior=recorded_acceptance(recorded, sampled=True))
        return self._policy

    policy = adaptive  # the name of earlier releases

    def learn(self, settings) -> Learner | None:
        """Learn the drafter online from the calls this spec serves with ``settings`` (an object whose
        ``attach(spec)`` builds the learner, e.g. ``training.online.OnlineConfig(budget=0.25)``), or stop
        with None / False. A learner already attached is replaced; what it learned stays in the drafter
        and in :attr:`metadata` (``save_pretrained`` records it). Returns the learner now attached."""
        check_learner_settings(settings)
        with self._lock:
            if self.learning is not None:
                self.metadata.update(self.learning.adapter_metadata())
            self.learning = None
            if settings is not None and settings is not False:
                self.learning = settings.attach(self)
            return self.learning

    def save_pretrained(self, directory: str, **metadata) -> None:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (atomically); a kind with
        its own layout writes that instead (``DrafterKind.save``: the draft kind's model or LoRA)."""
        from .adapter import AdapterError, save_adapter

        entry = kinds.get(self.kind)
        if not entry.trainable:
            raise AdapterError(f"a {self.kind!r} drafter has no trained tensors to save as an adapter; "
                               f"attach it again with attach_heads(model, kind={self.kind!r}, ...)")
        if self.learning is not None:  # what the online learner changed (given metadata still wins)
            metadata = {**self.learning.adapter_metadata(), **metadata}
        if entry.save is not None:  # a kind with its own files (the draft kind: a whole model or a LoRA)
            entry.save(self, directory, **metadata)
            return
        save_adapter(self, directory, **metadata)


def build_spec(target: Backbone, kind: str, config,
               accuracy: Sequence[Sequence[float]] | None = None) -> SpeculativeModel:
    """A fresh drafter of ``kind`` on ``target``, on the backbone's device and dtype."""
    entry = kinds.get(kind)
    heads = entry.build_heads(target, config)
    if heads is not None:
        heads.to(device=target.device, dtype=target.dtype)
    if entry.target_view is not None:
        target = entry.target_view(target, config)
    return SpeculativeModel(target, heads, kind, config, accuracy)
