"""``TargetPin``: the target identity an adapter records, and the one check against a model."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from ..backbone import target_fingerprint
from .schema import TargetMismatchError, target_differences, weights_note

logger = logging.getLogger(__name__)

_SHAPE_FIELDS = ("vocab size", "hidden size")


@dataclass(frozen=True)
class TargetPin:
    """The ``target`` block of an adapter config (see :func:`heads.backbone.target_fingerprint`).

    Fields left unknown (None, as in checkpoints imported from other projects) are not compared.
    """

    recorded: dict

    @classmethod
    def of(cls, model, revision: str | None = None) -> "TargetPin":
        """The pin of ``model`` (its fingerprint, computed once)."""
        return cls(target_fingerprint(model, revision=revision))

    @property
    def verifiable(self) -> bool:
        """Whether the pin records a weights fingerprint (imported checkpoints may not)."""
        return self.recorded.get("weights_sha256") is not None

    def differences(self, other: "TargetPin | dict") -> list[str]:
        """Human-readable differences of the pinned fields between this pin and ``other``."""
        current = other.recorded if isinstance(other, TargetPin) else other
        return target_differences(self.recorded, current)

    def check(self, model, strict: bool = True, where: object = "adapter", source: str = "selfdraft",
              purpose: str | None = None) -> "TargetPin":
        """Compare with ``model``; returns ``model``'s pin.

        Weights match up to fp32/fp16/bf16 rounding (:func:`heads.fingerprint.sample_mismatches`); an
        older pin without a weights sample that cannot be checked against an fp16 model loads with a
        logged warning (:func:`heads.adapter.schema.weights_note`).
        A size mismatch always raises :class:`TargetMismatchError`. Another difference raises when
        ``strict`` (or when ``purpose`` is given: the model's own tensors are about to be written
        into an export, so it must be the target) and warns otherwise; an unverifiable pin warns.
        """
        current = TargetPin.of(model)
        differences = self.differences(current)
        if purpose is not None and differences:
            raise TargetMismatchError(f"{where}: --model is not this adapter's target ({purpose}): "
                                      + "; ".join(differences))
        shape = [d for d in differences if d.startswith(_SHAPE_FIELDS)]
        if shape:
            raise TargetMismatchError(f"{where}: the {source} checkpoint does not fit this model: " + "; ".join(shape))
        if differences:
            message = (f"adapter {where} was trained on another target ({self.recorded.get('name_or_path')!r}): "
                       + "; ".join(differences)
                       + ". Outputs stay correct but acceptance may drop: re-measure with `selfdraft check`.")
            if strict:
                raise TargetMismatchError(message)
            warnings.warn(message, stacklevel=3)
        elif not self.verifiable and purpose is None:
            warnings.warn(
                f"{where}: this {source} checkpoint records no target fingerprint, so it cannot be verified that it "
                f"was trained on this model (it names base model {self.recorded.get('name_or_path')!r}). Outputs "
                "stay correct; measure acceptance with `selfdraft check`.", stacklevel=3)
        note = weights_note(self.recorded, current.recorded)
        if note is not None and not shape:
            logger.warning("adapter %s: %s", where, note)
        if self.recorded.get("dtype") not in (None, current.recorded["dtype"]):
            logger.info("adapter %s was saved from a %s target; the model is %s (tensors are cast)",
                        where, self.recorded["dtype"], current.recorded["dtype"])
        return current
