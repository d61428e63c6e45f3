"""The variants of ``bench_eagle_recipe.py`` (this folder): recipes, initialisations and structural changes of the
EAGLE drafter, each changing one ingredient of the recipe before issue 13 (``BEFORE``)."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from heads.backbone import OutputRows, attention_layout
from training.sequences import collate

# ``selfdraft train``'s recipes before and after issue 13 (every variant starts from BEFORE)
BEFORE = {"eagle": dict(learning_rate=1e-3, token_weight=0.1), "medusa": dict(learning_rate=1e-3)}
AFTER = dict(learning_rate=1e-2, token_weight=1.0)

# name: kind, TrainConfig overrides of BEFORE (train), attach_heads options (options), init, other changes
VARIANTS = {
    "medusa": dict(kind="medusa"),
    "before": dict(),  # the command line's recipe before issue 13 (random init, no fit)
    "after": dict(train=AFTER, fit=True, eval_before=True),  # after issue 13: projection fitted, lr and weight
    "after-nofit": dict(train=AFTER),  # the same without the projection's least-squares start
    "random": dict(init="random"),  # the library's init, re-applied (so it reproduces whatever the default)
    "random-lr3e-3": dict(init="random", train=dict(learning_rate=3e-3)),
    "random-lr1e-2": dict(init="random", train=dict(learning_rate=1e-2)),
    "random-1000steps": dict(init="random", steps=1000),
    "random-noise0": dict(init="random", train=dict(feature_noise=0.0)),
    "random-token-only": dict(init="random", train=dict(feature_weight=0.0, token_weight=1.0)),
    "random-w1-1": dict(init="random", train=dict(feature_weight=1.0, token_weight=1.0)),
    "random-w0.1-1": dict(init="random", train=dict(feature_weight=0.1, token_weight=1.0)),
    "random-unroll3": dict(init="random", train=dict(unroll_steps=3)),
    "random-2layers": dict(init="random", options=dict(num_layers=2)),
    "random-mha": dict(init="random", mha=True),
    "random-prenorm-input": dict(init="random", prenorm_input=True),
    "random-own-head": dict(init="random", own_head=True),
    "random-eagle1": dict(init="random", options=dict(layout="eagle1")),
    "passthrough": dict(init="passthrough"),
    "passthrough-lr3e-3": dict(init="passthrough", train=dict(learning_rate=3e-3)),
    "passthrough-w1-1": dict(init="passthrough", train=dict(feature_weight=1.0, token_weight=1.0)),
    "zero-residual": dict(init="zero-residual"),
    "embed-gain": dict(init="embed-gain"),
    "norm-init": dict(init="norm-from-target"),
    "norm-init-lr1e-2": dict(init="norm-from-target", train=dict(learning_rate=1e-2)),
    "random-lr2e-2": dict(init="random", train=dict(learning_rate=2e-2)),
    "random-lr3e-2": dict(init="random", train=dict(learning_rate=3e-2)),
    "random-lr1e-2-w1-1": dict(init="random", train=dict(learning_rate=1e-2, token_weight=1.0)),
    "random-lr1e-2-token-only": dict(init="random", train=dict(learning_rate=1e-2, feature_weight=0.0,
                                                               token_weight=1.0)),
    "random-lr1e-2-noise0": dict(init="random", train=dict(learning_rate=1e-2, feature_noise=0.0)),
    "random-lr1e-2-unroll3": dict(init="random", train=dict(learning_rate=1e-2, unroll_steps=3)),
    "random-lr1e-2-eagle1": dict(init="random", train=dict(learning_rate=1e-2), options=dict(layout="eagle1")),
    "random-lr1e-2-w1-0.3": dict(init="random", train=dict(learning_rate=1e-2, token_weight=0.3)),
    "random-lr1e-2-w1-3": dict(init="random", train=dict(learning_rate=1e-2, token_weight=3.0)),
    "random-lr2e-2-w1-1": dict(init="random", train=dict(learning_rate=2e-2, token_weight=1.0)),
    "least-squares": dict(init="least-squares", eval_before=True),
    "least-squares-lr1e-2": dict(init="least-squares", train=dict(learning_rate=1e-2)),
    "least-squares-w1-1": dict(init="least-squares", train=dict(token_weight=1.0)),
    "least-squares-lr1e-2-w1-1": dict(init="least-squares", train=dict(learning_rate=1e-2, token_weight=1.0)),
    "lsq-plain": dict(init="lsq-plain", eval_before=True),
    "lsq-plain-w1-1": dict(init="lsq-plain", train=dict(token_weight=1.0)),
    "lsq-plain-lr1e-2": dict(init="lsq-plain", train=dict(learning_rate=1e-2)),
    "lsq-plain-lr1e-2-w1-1": dict(init="lsq-plain", train=dict(learning_rate=1e-2, token_weight=1.0)),
    "lsq-plain-lr1e-2-w1-0.3": dict(init="lsq-plain", train=dict(learning_rate=1e-2, token_weight=0.3)),
    "medusa-lr1e-2": dict(kind="medusa", train=dict(learning_rate=1e-2)),
    "random-x10-norm": dict(init="random", lr_scale={"decoder.norm.": 10}),
    "random-x10-projection": dict(init="random", lr_scale={"projection.": 10}),
    "random-x10-layers": dict(init="random", lr_scale={"decoder.layers.": 10}),
}


# ---- initialisations (applied to a freshly attached EAGLE drafter) ----

def init_random(drafter) -> None:
    """torch's default for the projection, transformers' Llama init (normal(0, initializer_range),
    zero biases, unit norms) for the decoder: what ``attach_heads`` built before issue 13."""
    if drafter.projection is not None:
        drafter.projection.reset_parameters()
    std = drafter.decoder.config.initializer_range
    for module in drafter.decoder.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "weight") and "Norm" in type(module).__name__:
            nn.init.ones_(module.weight)


def _zero_residual_outputs(drafter) -> None:
    for layer in drafter.decoder.layers:
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        nn.init.zeros_(layer.mlp.down_proj.weight)


def init_passthrough(drafter) -> None:
    """Random decoder with zero residual outputs; projection ``[0 | I]``: the untrained drafter
    returns (the norm of) ``f_t``."""
    init_random(drafter)
    _zero_residual_outputs(drafter)
    d = drafter.hidden_size
    with torch.no_grad():
        drafter.projection.weight.zero_()
        drafter.projection.weight[:, d:].copy_(torch.eye(d))
        drafter.projection.bias.zero_()


def init_zero_residual(drafter) -> None:
    """Random projection, zero residual outputs of the decoder layers."""
    init_random(drafter)
    _zero_residual_outputs(drafter)


def init_embed_gain(drafter, gain: float) -> None:
    """Random init, the projection's embedding half scaled by ``gain`` (rms(f) / rms(e)) so that both
    halves contribute alike."""
    init_random(drafter)
    with torch.no_grad():
        drafter.projection.weight[:, :drafter.hidden_size] *= gain


def init_norm_from_target(drafter, target_model) -> None:
    """Random init, the decoder copy's final norm set to the target's final norm (the scale of ``f``)."""
    init_random(drafter)
    with torch.no_grad():
        drafter.decoder.norm.weight.copy_(target_model.model.norm.weight)


@torch.no_grad()
def init_least_squares(drafter, target, sequences, pad_id: int, count: int = 64, ridge: float = 1e-3,
                       full: bool = True) -> None:
    """The projection fitted by ridge regression of the next feature on ``[e_{t+1}; f_t]`` over
    ``count`` training sequences. ``full``: also zero residual outputs and the final norm set to the
    target's (``w``), regressing ``f_{t+1} / w``, so that the untrained drafter is the best linear
    predictor of the next feature; else the decoder stays random and the target is ``f_{t+1}``."""
    init_random(drafter)
    weight = torch.ones(drafter.hidden_size)
    if full:
        _zero_residual_outputs(drafter)
        weight = target.model.model.norm.weight.detach()
        drafter.decoder.norm.weight.copy_(weight)
    inputs, outputs = [], []
    for start in range(0, min(count, len(sequences)), 8):
        ids, mask = collate(sequences[start:start + 8], pad_id)
        features = target.features(ids, None, mask, None)  # (B, T, d)
        embeddings = target.input_embeddings(ids)
        valid = mask[:, 1:].bool()
        inputs.append(torch.cat([embeddings[:, 1:], features[:, :-1]], dim=-1)[valid])
        outputs.append((features[:, 1:] / weight)[valid])
    x, y = torch.cat(inputs).double(), torch.cat(outputs).double()
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype)
    solution = torch.linalg.solve(gram, x.T @ y)  # (2d + 1, d)
    drafter.projection.weight.copy_(solution[:-1].T.float())
    drafter.projection.bias.copy_(solution[-1].float())


INITS = {"random": init_random, "passthrough": init_passthrough, "zero-residual": init_zero_residual}


# ---- structural variants ----

def use_mha(drafter) -> None:
    """Replace the decoder copy's grouped-query attention by full multi-head attention."""
    config = copy.deepcopy(drafter.decoder.config)
    config.num_key_value_heads = config.num_attention_heads
    decoder = type(drafter.decoder)(config)
    decoder.embed_tokens = None
    drafter.decoder = decoder
    drafter.layout = attention_layout(config)


def use_own_head(spec) -> None:
    """A trainable copy of the output head for the drafter (Medusa has one per head)."""
    drafter = spec.heads
    drafter.own_head = nn.Parameter(spec.target.output_head.weight.detach().clone())
    drafter.draft_rows = lambda target: OutputRows(drafter.own_head, None, None)


def use_prenorm_input(hook, model):
    """The drafter reads the top layer's residual stream before the final norm (training and the
    teacher-forced evaluation only: decoding feeds post-norm features)."""
    captured = {}
    handle = model.model.norm.register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("x", inputs[0]))
    original = hook._targets

    def targets(input_ids, attention_mask):
        top, _, teacher, embeddings = original(input_ids, attention_mask)
        return top, captured["x"], teacher, embeddings

    hook._targets = targets
    return handle


@contextlib.contextmanager
def scaled_learning_rates(drafter, scales: dict | None):
    """While active, AdamW built over the drafter's tensors gives those whose name starts with a key
    of ``scales`` that multiple of the learning rate (one group per multiple)."""
    if not scales:
        yield
        return
    original = torch.optim.AdamW
    names = {id(p): name for name, p in drafter.named_parameters()}

    def grouped(params, lr, **options):
        params = list(params)
        flat = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        groups = {}
        for parameter in flat:
            name = names.get(id(parameter), "")
            factor = next((value for prefix, value in scales.items() if name.startswith(prefix)), 1.0)
            groups.setdefault(factor, []).append(parameter)
        return original([{"params": ps, "lr": lr * factor} for factor, ps in groups.items()], lr=lr, **options)

    torch.optim.AdamW = grouped
    try:
        yield
    finally:
        torch.optim.AdamW = original

def apply_variant(spec, variant: dict, model, sequences, pad_id: int) -> None:
    """The variant's structural changes and initialisation, on a freshly attached EAGLE drafter."""
    if variant.get("mha"):
        use_mha(spec.heads)
    init = variant.get("init")
    if init == "norm-from-target":
        init_norm_from_target(spec.heads, model)
    elif init in ("least-squares", "lsq-plain"):
        init_least_squares(spec.heads, spec.target, sequences, pad_id, full=init == "least-squares")
    elif init == "embed-gain":
        features = spec.target.features(sequences[0][None], None, None, None)
        embeddings = spec.target.input_embeddings(sequences[0][None])
        init_embed_gain(spec.heads, float(features.pow(2).mean().sqrt() / embeddings.pow(2).mean().sqrt()))
    elif init is not None:
        INITS[init](spec.heads)
    if variant.get("own_head"):
        use_own_head(spec)
