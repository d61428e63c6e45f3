"""What ``selfdraft train`` distils for: the temperatures of the distillation data, of the
divergence and of the on-policy share, from the recipe flags, and the default recipe used when none
of them is given (one adapter for greedy and sampled serving). No torch import: ``--help`` reads
the defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from heads import kinds

DIVERGENCE_TEMPERATURE = 1.0
"""``--temperature`` when not given."""
RECIPE_FLAGS = ("temperature", "data_temperature", "on_policy", "on_policy_ratio", "on_policy_temperature",
                "original_text")
"""Destinations of the flags that choose what the adapter is trained for; giving any of them
specialises the recipe (none: :data:`DEFAULT_RECIPE`)."""


@dataclass(frozen=True)
class Recipe:
    """What the distillation data and the divergence are drawn at.

    ``data_temperatures``: prompt ``i``'s continuation is drawn at ``data_temperatures[i % len]``
    (0: greedy); ``on_policy_ratio``: share of each batch from on-policy sequences sampled at
    ``on_policy_temperature`` (None: ``temperature``); ``serving``: ``"any"`` for the default recipe
    (one adapter for greedy and sampled traffic), ``"specialised"`` when a recipe flag was given;
    ``evaluated_at``: the temperatures the held-out acceptance is measured at."""

    temperature: float
    data_temperatures: tuple[float, ...]
    on_policy_ratio: float
    on_policy_temperature: float | None
    serving: str
    evaluated_at: tuple[float, ...]

    def record(self, config) -> dict:
        """The temperature fields of the adapter's ``training`` entry (``config``: the run's
        ``TrainConfig``). ``data_temperature`` is a number for one data temperature, the list (cycled
        over prompts) for several; ``serving`` says what the recipe was trained for (``any``: the
        default recipe, greedy and sampled; ``specialised``: a recipe flag was given) and
        ``serving_temperatures`` the temperatures its held-out acceptance is measured at."""
        temperatures = list(self.data_temperatures)
        on_policy = config.on_policy_ratio > 0
        return {
            "serving": self.serving, "serving_temperatures": list(self.evaluated_at),
            "temperature": self.temperature,
            "data_temperature": temperatures[0] if len(set(temperatures)) == 1 else temperatures,
            "on_policy": on_policy, "on_policy_ratio": config.on_policy_ratio,
            "on_policy_refresh": config.on_policy_refresh if on_policy else None,
            "on_policy_temperature": config.serving_temperature if on_policy else None,
        }


DEFAULT_RECIPE = Recipe(temperature=DIVERGENCE_TEMPERATURE, data_temperatures=(0.0, 0.7), on_policy_ratio=0.0,
                        on_policy_temperature=None, serving="any", evaluated_at=(0.0, 0.7))
"""The recipe of ``selfdraft train`` without a recipe flag: every other prompt's continuation greedy,
the others sampled at 0.7, forward KL at temperature 1; measured at greedy and 0.7. A kind may name
other data temperatures (:func:`default_recipe`)."""


def default_recipe(kind: str | None = None) -> Recipe:
    """:data:`DEFAULT_RECIPE` with ``kind``'s own default data temperatures where its command-line
    module names them (``DATA_TEMPERATURES``; Medusa: greedy continuations only). Still trained for,
    recorded as and measured at any serving temperature. ValueError for a kind ``selfdraft train``
    does not know."""
    lines = kinds.command_lines()
    if kind is not None and kind not in lines:
        raise ValueError(f"kind must be one of {tuple(lines)} (or None); got {kind!r}")
    data = getattr(lines.get(kind), "DATA_TEMPERATURES", None) if kind else None
    return DEFAULT_RECIPE if data is None else replace(DEFAULT_RECIPE, data_temperatures=tuple(data))


def on_policy_ratio(args) -> float:
    """``--on-policy-ratio``, else 0.5 with ``--on-policy`` and 0 without; ValueError for the
    contradiction ``--on-policy --on-policy-ratio 0``."""
    if args.on_policy_ratio is None:
        return 0.5 if args.on_policy else 0.0
    if args.on_policy and args.on_policy_ratio == 0:
        raise ValueError("--on-policy with --on-policy-ratio 0: give a ratio in (0, 1] or drop --on-policy")
    return args.on_policy_ratio


def recipe(args) -> Recipe:
    """The :class:`Recipe` of the flags: :func:`default_recipe` of ``--kind`` when no flag of
    :data:`RECIPE_FLAGS` was given, else the flags as given with the specialised defaults (divergence at
    :data:`DIVERGENCE_TEMPERATURE`, greedy data, no on-policy share; measured greedy, and at the
    on-policy temperature when there is an on-policy share)."""
    given = [name for name in RECIPE_FLAGS if getattr(args, name, None) not in (None, False)]
    if not given:
        return default_recipe(getattr(args, "kind", None))
    temperature = DIVERGENCE_TEMPERATURE if args.temperature is None else args.temperature
    ratio = on_policy_ratio(args)
    on_policy_temperature = temperature if args.on_policy_temperature is None else args.on_policy_temperature
    return Recipe(temperature=temperature, data_temperatures=tuple(args.data_temperature or (0.0,)),
                  on_policy_ratio=ratio, on_policy_temperature=args.on_policy_temperature, serving="specialised",
                  evaluated_at=tuple(sorted({0.0, on_policy_temperature if ratio else 0.0})))
