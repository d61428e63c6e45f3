"""EAGLE's training hook: what the generic distillation trainer (:mod:`training.trainer`) calls.

Per micro-batch, **one** backbone forward without gradients gives the top-layer features ``f``
(regression targets), the drafter's input features (``f`` itself, or the fused layers of
``feature_layers``) and the teacher logits. Features are computed online, per batch; nothing is
cached on disk. The drafter reads ``(f_t + noise, x_{t+1})`` and predicts ``f_{t+1}``; with
``unroll_steps = k > 1`` it then drafts ``k - 1`` more steps on its own predictions, each step
attending to the teacher-forced prefix and its own chain as a draft tree node does at decode time
(training-time test, EAGLE-3/HASS). Step ``j`` at origin ``t`` is scored against ``f_{t+j}`` and
the target's distribution at ``t + j``::

    loss = sum_j head_decay**(j-1) * (feature_weight * smooth_l1(pred, f) + token_weight * D(q || p))

with ``D`` the configured divergence (EAGLE-1: cross entropy, i.e. forward KL up to a constant;
weights 1.0 and 0.1). With a reduced draft vocabulary the teacher distribution is restricted to
it and positions whose target token lies outside it are skipped (EAGLE-3).

Before the first step (:meth:`EagleLoss.prepare`) the projection over ``[e_{t+1}; f_t]`` is fitted
by ridge regression of ``f_{t+1}`` on the first :data:`FIT_SEQUENCES` training sequences
(:func:`fit_linear`), so that training starts from the best linear next-feature predictor rather
than a random map; the decoder layer stays as built. Medusa's heads start as good predictors (the
identity and a copy of the output head); a random EAGLE drafter does not, and this start raises
held-out top-1 accuracy at every drafting step (``benchmarks/studies/eagle_recipe``; figures in
CHANGELOG.md).

Parallel drafting (``EagleConfig.parallel = K > 1``, :mod:`heads.eagle.parallel`), ``heads`` mode
(the default): the drafter trains exactly as a sequential one, and parallel head ``j`` reads the
drafter's step-1 prediction at the anchor or the anchor's input feature (``EagleConfig.head_input``;
gradient stopped) and is scored against the target's distribution ``j + 1``
tokens after the drafter's depth 1 (:func:`depth_head_losses`). ``mask`` mode: the drafter's
one training forward runs the teacher-forced pairs and ``K - 1`` blocks of mask queries
(:meth:`~heads.eagle.modules.EagleHeads.parallel_forward`); anchor ``t``'s mask query ``j`` sees the
pairs ``<= t`` and its own earlier mask queries, as at decode time, and is scored like unrolled
step ``j + 1`` (feature at ``t + j + 1``, the same loss and ``head_decay`` weights). The mask
queries' inputs start at the data's mean next-token embedding and mean input feature
(:meth:`EagleLoss.fit_mask_inputs`); held-out per-depth accuracy shapes the static tree.

The divergences come from the trainer (``context.losses``): this package does not import
``training``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..draft_vocab import frequent_tokens, vocabulary_swaps


FIT_SEQUENCES = 64
"""Training sequences the projection is fitted on before training (:meth:`EagleLoss.prepare`)."""
RIDGE = 1e-3
"""Ridge of that fit, relative to the mean diagonal of the inputs' Gram matrix."""


def fit_linear(gram: torch.Tensor, cross: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression from accumulated moments: ``gram = X^T X`` ``[p + 1, p + 1]`` and ``cross =
    X^T Y`` ``[p + 1, q]`` of inputs ``X`` ``[N, p]`` extended by a column of ones (the bias) and
    targets ``Y`` ``[N, q]``. Minimises ``|X W - Y|^2 + ridge * mean(diag(gram)) * |W|^2``; returns
    ``(weight [q, p], bias [q])`` as ``nn.Linear`` holds them (float64)."""
    size = gram.shape[0]
    penalty = ridge * gram.diagonal().mean() * torch.eye(size, dtype=gram.dtype, device=gram.device)
    solution = torch.linalg.solve(gram + penalty, cross)  # (p + 1, q)
    return solution[:-1].T, solution[-1]


def draft_vocabulary_mask(token_map: torch.Tensor | None, teacher_logits: torch.Tensor) -> torch.Tensor | None:
    """``[V]`` True at the target ids of the draft vocabulary ``token_map`` (None without one)."""
    if token_map is None:
        return None
    in_draft = torch.zeros(teacher_logits.shape[-1], dtype=torch.bool, device=teacher_logits.device)
    in_draft[token_map] = True
    return in_draft


def shifted_teacher(teacher_logits: torch.Tensor, attention_mask: torch.Tensor, shift: int,
                    token_map: torch.Tensor | None, in_draft: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prediction at anchor ``t`` is scored against ``shift`` positions on: the valid anchors
    ``[B, T - shift]`` (real tokens whose teacher token lies in the draft vocabulary) and the teacher's
    logits there ``[B, T - shift, V']`` (restricted to the draft vocabulary)."""
    valid = attention_mask[:, shift:].bool()
    teacher = teacher_logits[:, shift:]
    if in_draft is not None:
        valid = valid & in_draft[teacher.argmax(-1)]
        teacher = teacher[..., token_map]
    return valid, teacher


def eagle_losses(predictions: Sequence[torch.Tensor], top_features: torch.Tensor, teacher_logits: torch.Tensor,
                 attention_mask: torch.Tensor, student_logits, config,
                 token_map: torch.Tensor | None = None, head_features=None, *,
                 losses, parallel: bool = False) -> tuple[torch.Tensor, list[float]]:
    """Weighted EAGLE loss over unrolled steps and each step's top-1 agreement with the target.

    Args:
        predictions: per step ``j = 1..k``, ``[B, T, d]``; row ``t`` predicts the feature at ``t + j``.
        top_features: ``[B, T, d]`` the target's top-layer features; ``teacher_logits`` ``[B, T, V]``.
        attention_mask: ``[B, T]`` 1 at real tokens.
        student_logits: maps predicted features ``[..., d]`` to the drafter's logits ``[..., V']``.
        config: the trainer's ``TrainConfig`` (weights, divergence, temperature, decay).
        token_map: ``[V']`` target ids of the draft vocabulary (None: the whole vocabulary).
        head_features: maps predictions to what the output head reads (the ``eagle3`` layout's final
            norm), the space of ``top_features`` that the regression compares in (None: identity).
        losses: the namespace of divergences (``training.losses``).
        parallel: ``predictions`` are parallel drafting's depths (the teacher-forced pairs, then the
            mask queries); the mask queries' losses are scaled by ``config.mask_query_weight``.
    """
    length = top_features.shape[1]
    in_draft = draft_vocabulary_mask(token_map, teacher_logits)
    total = top_features.new_zeros((), dtype=torch.float32)
    agreement = []
    for step, predicted in enumerate(predictions, start=1):
        if length <= step:
            agreement.append(0.0)
            continue
        valid, teacher = shifted_teacher(teacher_logits, attention_mask, step, token_map, in_draft)
        features = predicted[:, :length - step].float()
        logits = student_logits(features).float()
        regressed = features if head_features is None else head_features(features)
        loss = config.feature_weight * losses.feature_regression(regressed, top_features[:, step:], valid)
        loss = loss + config.token_weight * losses.divergence(config.divergence, logits, teacher, config.temperature,
                                                              config.jsd_beta, valid)
        scale = config.mask_query_weight if parallel and step > 1 else 1.0  # the mask queries' depths
        total = total + scale * config.head_decay ** (step - 1) * loss
        with torch.no_grad():
            agreement.append(float(losses.masked_mean((logits.argmax(-1) == teacher.argmax(-1)).float(), valid)))
    return total, agreement


def depth_head_losses(depth_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor,
                      attention_mask: torch.Tensor, config, token_map: torch.Tensor | None = None, *,
                      losses) -> tuple[torch.Tensor, list[float]]:
    """Parallel heads' loss (``heads`` mode): head ``j`` (``depth_logits[j - 1]`` ``[B, T, V']``, read
    at anchor ``t``) against the target's distribution for the token at ``t + j + 2``, i.e.
    ``teacher_logits[:, t + j + 1]``, weighted ``head_decay ** j`` like unrolled step ``j + 1``;
    and each head's top-1 agreement."""
    length = teacher_logits.shape[1]
    in_draft = draft_vocabulary_mask(token_map, teacher_logits)
    total = teacher_logits.new_zeros((), dtype=torch.float32)
    agreement = []
    for index, logits in enumerate(depth_logits, start=1):
        shift = index + 1
        if length <= shift:
            agreement.append(0.0)
            continue
        valid, teacher = shifted_teacher(teacher_logits, attention_mask, shift, token_map, in_draft)
        student = logits[:, :length - shift].float()
        loss = losses.divergence(config.divergence, student, teacher, config.temperature, config.jsd_beta, valid)
        total = total + config.head_decay ** index * config.token_weight * loss
        with torch.no_grad():
            agreement.append(float(losses.masked_mean((student.argmax(-1) == teacher.argmax(-1)).float(), valid)))
    return total, agreement


class EagleLoss:
    """The EAGLE training hook (``KIND.loss``); ``context``: see :class:`training.trainer.LossContext`.
    Refuses a config it cannot train (``hard_label_weight`` belongs to Medusa)."""

    description = "distilling EAGLE drafter"

    def __init__(self, context) -> None:
        if context.config.hard_label_weight:
            raise ValueError("hard_label_weight applies to Medusa training only; EAGLE uses feature_weight and "
                             "token_weight")
        self.context = context
        self.spec = context.spec
        self.config = context.config
        self.parallel = self.spec.config.parallel
        self.mask_queries = self.parallel > 1 and self.spec.heads.mask_feature is not None
        if self.mask_queries and context.config.unroll_steps > 1:
            raise ValueError(f"unroll_steps ({context.config.unroll_steps}) trains sequential drafting; a drafter "
                             f"with mask queries (parallel={self.parallel}, parallel_mode 'mask') trains them "
                             "instead: use unroll_steps 1, or parallel_mode 'heads'")

    def prepare(self) -> None:
        """Fit the projection (:meth:`fit_projection`); with a reduced draft vocabulary, choose it
        (the most frequent target tokens in the training data)."""
        heads = self.spec.heads
        if heads.token_map is not None:
            heads.set_token_map(frequent_tokens(self.context.train_sequences, self.spec.target.vocab_size,
                                                heads.draft_vocab_size), self.spec.target)
        self.fit_projection()
        if heads.mask_feature is not None:
            self.fit_mask_inputs()

    def swap_vocabulary(self, counts: torch.Tensor, limit: int) -> int:
        """Online learning: with a reduced draft vocabulary, swap in up to ``limit`` tokens frequent in
        served traffic (``counts`` ``[V]`` of its predicted tokens) that it cannot draft, in place of its
        rarest (:func:`heads.draft_vocab.vocabulary_swaps`); the tokens swapped (0 without one)."""
        heads = self.spec.heads
        if heads.token_map is None:
            return 0
        positions, token_ids = vocabulary_swaps(heads.token_map, counts, limit)
        if positions.numel():
            heads.replace_tokens(positions, token_ids, self.spec.target)
        return int(positions.numel())

    @torch.no_grad()
    def fit_projection(self) -> None:
        """Set the projection (``2d -> d``, the ``native`` and ``eagle1`` layouts) to the ridge regression
        of the next top-layer feature ``f_{t+1}`` on ``[e_{t+1}; fuse(features_t)]`` over the first
        :data:`FIT_SEQUENCES` training sequences (no noise): the untrained drafter's input is then the
        best linear guess of what it must output. A pure function of the data and the drafter's other
        tensors, so every process computes the same start. ``eagle3`` (no projection): nothing."""
        heads = self.spec.heads
        if heads.projection is None:
            return
        size = 2 * heads.hidden_size + 1
        gram = torch.zeros(size, size, dtype=torch.float64, device=heads.projection.weight.device)
        cross = torch.zeros(size, heads.hidden_size, dtype=torch.float64, device=gram.device)
        sequences = self.context.train_sequences[:FIT_SEQUENCES]
        for start in range(0, len(sequences), 8):
            input_ids, attention_mask = self.context.collate(sequences[start:start + 8])
            top, inputs, _, embeddings = self._targets(input_ids, attention_mask)
            valid = attention_mask[:, 1:].bool()  # (B, T - 1): pairs (t, t + 1) inside the sequence
            features = torch.cat([embeddings[:, 1:], heads.fuse(inputs)[:, :-1]], dim=-1)[valid].double()  # (N, 2d)
            features = torch.cat([features, features.new_ones(len(features), 1)], dim=1)
            gram += features.T @ features
            cross += features.T @ top[:, 1:][valid].double()
        weight, bias = fit_linear(gram, cross)
        heads.projection.weight.copy_(weight)
        heads.projection.bias.copy_(bias)

    @torch.no_grad()
    def fit_mask_inputs(self) -> None:
        """Parallel drafting: start the mask queries' inputs at the mean next-token embedding and the
        mean drafter input feature of the first :data:`FIT_SEQUENCES` training sequences (with the fitted
        projection, a mask query then starts from the average next feature)."""
        heads = self.spec.heads
        embedding_sum = torch.zeros(heads.hidden_size, dtype=torch.float64, device=heads.mask_embedding.device)
        feature_sum, count = torch.zeros_like(embedding_sum), 0
        sequences = self.context.train_sequences[:FIT_SEQUENCES]
        for start in range(0, len(sequences), 8):
            input_ids, attention_mask = self.context.collate(sequences[start:start + 8])
            _, inputs, _, embeddings = self._targets(input_ids, attention_mask)
            valid = attention_mask[:, 1:].bool()  # (B, T - 1)
            embedding_sum += embeddings[:, 1:][valid].double().sum(0)
            feature_sum += heads.fuse(inputs)[:, :-1][valid].double().sum(0)
            count += int(valid.sum())
        if count:
            heads.mask_embedding.copy_(embedding_sum / count)
            heads.mask_feature.copy_(feature_sum / count)

    @torch.no_grad()
    def _backbone(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The backbone's outputs a memo may keep per sequence: ``(top [B, T, d],)``, or ``(top, inputs
        [B, T, F])`` where the drafter reads other layers than the top one."""
        target = self.spec.target
        if target.feature_layers is None:
            return (target.features(input_ids, None, attention_mask, None),)
        return tuple(target.hidden_features(input_ids, None, attention_mask, None, target.feature_layers))

    @torch.no_grad()
    def _targets(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys=None):
        """Top features ``[B, T, d]``, drafter inputs ``[B, T, F]`` (one backbone forward, or the
        context's memo for rows whose ``keys`` it holds), teacher logits ``[B, T, V]`` (float) and
        token embeddings ``[B, T, d]``."""
        memo = getattr(self.context, "backbone_memo", None)
        if memo is None or keys is None:
            outputs = self._backbone(input_ids, attention_mask)
        else:
            outputs = memo.outputs(keys, input_ids, attention_mask, self._backbone)
        top, inputs = outputs[0], outputs[-1]
        target = self.spec.target
        return top, inputs, target.logits(top).float(), target.input_embeddings(input_ids)

    def _noise(self, inputs: torch.Tensor, attention_mask: torch.Tensor, indices: list[int], step: int):
        """Uniform noise ``U(-a, a)`` ``[B, T, F]``, a pure function of (seed, step, sequence index), so
        that it does not depend on how a batch is split across processes or micro-steps."""
        width = self.config.feature_noise
        noise = torch.zeros(inputs.shape, dtype=torch.float32)
        for row, (index, length) in enumerate(zip(indices, attention_mask.sum(-1).tolist())):
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 10_007 + index)
            noise[row, :length] = (torch.rand(length, inputs.shape[-1], generator=generator) * 2 - 1) * width
        return noise.to(device=inputs.device, dtype=inputs.dtype)

    def _loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int,
              noise_indices: list[int] | None = None, step: int = 0, keys: list[int] | None = None):
        """Loss and agreement of ``steps`` unrolled steps; also the predictions, the drafter's logits
        function and the teacher logits (for :meth:`rank_accuracy`). Noise only with ``noise_indices``;
        ``keys``: the rows' sequence keys, for the context's backbone memo."""
        accelerator = self.context.accelerator
        top, inputs, teacher, embeddings = self._targets(input_ids, attention_mask, keys)
        if noise_indices is not None and self.config.feature_noise:
            inputs = inputs + self._noise(inputs, attention_mask, noise_indices, step)
        drafter = accelerator.unwrap_model(heads)
        with accelerator.autocast():  # mask queries: the K depths of one forward
            predictions = heads(inputs, embeddings, steps, parallel=self.mask_queries)
            depth_logits = (drafter.depth_logits(self.spec.target, drafter.head_inputs(predictions[0], inputs))
                            if drafter.parallel_heads is not None else [])
        rows = drafter.draft_rows(self.spec.target)

        def logits(features: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., V') through the frozen head
            return self.spec.target.logits(features.to(top.dtype), rows)

        loss, agreement = eagle_losses(predictions, top, teacher, attention_mask, logits, self.config,
                                       drafter.token_map, drafter.head_features, losses=self.context.losses,
                                       parallel=self.mask_queries)
        if depth_logits:  # heads mode: depth j + 1 at anchor t is the target's token at t + j + 2
            head_loss, head_agreement = depth_head_losses(depth_logits, teacher, attention_mask, self.config,
                                                          drafter.token_map, losses=self.context.losses)
            loss, agreement = loss + head_loss, agreement + head_agreement
        return loss, agreement, predictions, logits, teacher, depth_logits

    def clip_groups(self) -> list[list[torch.nn.Parameter]]:
        """``heads`` mode: the parallel heads' gradient norm is clipped apart from the drafter's (the
        trainer clips each group to ``max_grad_norm``), so that their losses, which never reach the
        drafter's tensors, do not scale its updates down through a shared clip either."""
        heads = self.spec.heads
        return [list(heads.parallel_heads.parameters())] if heads.parallel_heads is not None else []

    def micro_loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor, indices: list[int],
                   step: int) -> tuple[torch.Tensor, list[float]]:
        loss, agreement, *_ = self._loss(heads, input_ids, attention_mask, self.config.unroll_steps, indices, step,
                                         keys=indices)
        return loss, agreement

    def finish(self, accuracy: list[list[float]]) -> None:
        """Sequential drafting: nothing to update (its tree is built dynamically). Parallel drafting:
        the measured per-depth accuracy shapes its static tree from now on (kept in the adapter)."""
        if self.parallel > 1:
            self.spec.accuracy = accuracy
            self.spec.set_tree(None)

    @torch.no_grad()
    def rank_accuracy(self, max_rank: int = 10, steps: int | None = None) -> list[list[float]]:
        """On held-out sequences, drafting a chain on its own predictions (no noise): per step
        ``j`` (default ``max(unroll_steps, 3)``), the share of positions where the target's token
        at ``t + j`` is the drafter's rank-r candidate, r < ``max_rank``. Parallel drafting: per
        depth ``j = 1..parallel`` of its one forward (the real pair, then the mask queries)."""
        heads = self.spec.heads
        if self.parallel > 1:  # one forward's depths: sequential step 1 and the heads, or the mask queries
            steps, forward_steps = self.parallel, (self.parallel if self.mask_queries else 1)
        else:
            steps = forward_steps = steps or max(self.config.unroll_steps, 3)
        counts, total = torch.zeros(steps, max_rank), 0
        validation = self.context.validation_sequences
        keys = getattr(self.context, "validation_keys", None)
        for start in range(0, len(validation), 4):
            input_ids, attention_mask = self.context.collate(validation[start:start + 4])
            _, _, predictions, logits, teacher, depth_logits = self._loss(
                heads, input_ids, attention_mask, forward_steps, keys=keys[start:start + 4] if keys else None)
            length = input_ids.shape[1]
            scored = [(predicted, logits) for predicted in predictions]
            scored += [(head_logits, lambda values: values) for head_logits in depth_logits]
            for index, (predicted, to_scores) in enumerate(scored[:steps]):
                shift = index + 1
                if length <= shift:
                    continue
                valid = attention_mask[:, shift:].bool()
                scores = to_scores(predicted[:, :length - shift])  # (B, T', V')
                ranked = heads.target_ids(scores.topk(min(max_rank, scores.shape[-1]), dim=-1).indices)
                hits = ranked == teacher[:, shift:].argmax(-1, keepdim=True)  # (B, T', R)
                counts[index, :hits.shape[-1]] += hits[valid].float().sum(0).cpu()
                if index == 0:
                    total += int(valid.sum())
        return (counts / total).tolist() if total else []
