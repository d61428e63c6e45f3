"""Tests for training/losses.py against hand-computed values (plain `math`, not torch)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training import losses

P = [0.5, 0.25, 0.25]  # teacher
Q = [0.25, 0.5, 0.25]  # student
LOSS_FUNCTIONS = {
    "fkl": losses.forward_kl,
    "rkl": losses.reverse_kl,
    "jsd": losses.jsd,
    "tvd": losses.total_variation,
    "ce": losses.soft_cross_entropy,
    "nla": losses.negative_log_acceptance,
    "lk_hybrid": losses.lk_hybrid,
}


def logits_of(probabilities: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``probabilities`` (zeros become -inf)."""
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probabilities])


def kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def test_divergences_tuple() -> None:
    assert losses.DIVERGENCES == ("fkl", "rkl", "jsd", "tvd", "ce", "nla", "lk_hybrid")


def test_forward_kl_hand_computed() -> None:
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # = 0.25 * ln 2
    value = losses.forward_kl(logits_of(Q), logits_of(P))
    assert value.shape == ()
    assert value.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.25 * math.log(2))


def test_reverse_kl_hand_computed() -> None:
    p, q = [0.75, 0.25], [0.5, 0.5]
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert losses.reverse_kl(logits_of(q), logits_of(p)).item() == pytest.approx(expected, abs=1e-6)
    assert losses.forward_kl(logits_of(q), logits_of(p)).item() == pytest.approx(
        kl(p, q), abs=1e-6
    )


def test_jsd_hand_computed_symmetric() -> None:
    p, q = [1.0, 0.0], [0.0, 1.0]  # disjoint supports: JSD(0.5) = ln 2
    assert losses.jsd(logits_of(q), logits_of(p)).item() == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_beta_weights_teacher(beta: float) -> None:
    m = [beta * x + (1 - beta) * y for x, y in zip(P, Q)]
    expected = beta * kl(P, m) + (1 - beta) * kl(Q, m)
    value = losses.jsd(logits_of(Q), logits_of(P), beta=beta)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_jsd_beta_is_teacher_weight_not_student() -> None:
    p, q = [0.9, 0.1], [0.2, 0.8]
    beta = 0.2
    m_teacher = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    expected = beta * kl(p, m_teacher) + (1 - beta) * kl(q, m_teacher)
    swapped_m = [beta * y + (1 - beta) * x for x, y in zip(p, q)]
    swapped = beta * kl(q, swapped_m) + (1 - beta) * kl(p, swapped_m)
    value = losses.jsd(logits_of(q), logits_of(p), beta=beta).item()
    assert value == pytest.approx(expected, abs=1e-6)
    assert abs(value - swapped) > 1e-3


def test_total_variation_hand_computed() -> None:
    expected = 0.5 * (0.25 + 0.25 + 0.0)
    assert losses.total_variation(logits_of(Q), logits_of(P)).item() == pytest.approx(expected)


def test_soft_cross_entropy_hand_computed() -> None:
    expected = -(0.5 * math.log(0.25) + 0.25 * math.log(0.5) + 0.25 * math.log(0.25))
    value = losses.soft_cross_entropy(logits_of(Q), logits_of(P)).item()
    assert value == pytest.approx(expected, abs=1e-6)
    entropy = -sum(x * math.log(x) for x in P)
    assert value == pytest.approx(kl(P, Q) + entropy, abs=1e-6)


def test_hard_cross_entropy_hand_computed_and_ignore_index() -> None:
    logits = torch.stack([logits_of(Q), logits_of(P)])  # [2, 3]
    targets = torch.tensor([1, -100])
    value = losses.hard_cross_entropy(logits, targets)
    assert value.shape == (2,)
    assert value[0].item() == pytest.approx(-math.log(0.5), abs=1e-6)
    assert value[1].item() == 0.0
    with pytest.raises(ValueError, match="target_ids"):
        losses.hard_cross_entropy(logits, torch.tensor([1, 2, 0]))


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd", "nla", "lk_hybrid"])
def test_zero_for_identical_distributions(kind: str) -> None:
    logits = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(0))
    value = LOSS_FUNCTIONS[kind](logits, logits.clone())
    assert value.shape == (4, 5)
    assert torch.allclose(value, torch.zeros_like(value), atol=1e-6)


def test_soft_cross_entropy_of_identical_is_entropy() -> None:
    value = losses.soft_cross_entropy(logits_of(P), logits_of(P)).item()
    assert value == pytest.approx(-sum(x * math.log(x) for x in P), abs=1e-6)


logit_rows = st.lists(
    st.lists(st.floats(-20, 20, allow_nan=False), min_size=6, max_size=6), min_size=2, max_size=2
)


@settings(max_examples=40, deadline=None)
@given(rows=logit_rows, temperature=st.sampled_from([0.5, 1.0, 3.0]))
def test_divergences_non_negative(rows: list[list[float]], temperature: float) -> None:
    student, teacher = torch.tensor(rows[0]), torch.tensor(rows[1])
    for kind, function in LOSS_FUNCTIONS.items():
        value = function(student, teacher, temperature=temperature).item()
        assert math.isfinite(value), kind
        assert value >= -1e-6, kind
    assert losses.jsd(student, teacher).item() <= math.log(2) + 1e-6
    assert losses.total_variation(student, teacher).item() <= 1 + 1e-6


@settings(max_examples=25, deadline=None)
@given(rows=logit_rows)
def test_symmetry(rows: list[list[float]]) -> None:
    a, b = torch.tensor(rows[0]), torch.tensor(rows[1])
    for function in (losses.jsd, losses.total_variation):
        assert function(a, b).item() == pytest.approx(function(b, a).item(), abs=1e-5)
    assert losses.forward_kl(a, b).item() == pytest.approx(losses.reverse_kl(b, a).item(), abs=1e-5)


def test_kl_is_not_symmetric() -> None:
    p, q = [0.9, 0.05, 0.05], [0.4, 0.4, 0.2]
    forward = losses.forward_kl(logits_of(q), logits_of(p)).item()
    backward = losses.forward_kl(logits_of(p), logits_of(q)).item()
    assert forward == pytest.approx(kl(p, q), abs=1e-6)
    assert backward == pytest.approx(kl(q, p), abs=1e-6)
    assert abs(forward - backward) > 0.05
    assert losses.reverse_kl(logits_of(q), logits_of(p)).item() == pytest.approx(backward, abs=1e-6)


def test_temperature_matches_manual_softmax() -> None:
    student, teacher = [2.0, 0.0, -1.0], [0.0, 3.0, 1.0]
    for temperature in (0.5, 2.0, 4.0):
        p = softmax([v / temperature for v in teacher])
        q = softmax([v / temperature for v in student])
        args = (torch.tensor(student), torch.tensor(teacher))
        assert losses.forward_kl(*args, temperature=temperature).item() == pytest.approx(
            kl(p, q), abs=1e-6
        )
        assert losses.reverse_kl(*args, temperature=temperature).item() == pytest.approx(
            kl(q, p), abs=1e-6
        )
        tvd = 0.5 * sum(abs(x - y) for x, y in zip(p, q))
        assert losses.total_variation(*args, temperature=temperature).item() == pytest.approx(tvd)


def test_higher_temperature_softens() -> None:
    student = torch.tensor([4.0, 0.0, -2.0, 1.0])
    teacher = torch.tensor([-1.0, 3.0, 0.5, 0.0])
    values = [losses.forward_kl(student, teacher, temperature=t).item() for t in (1, 2, 8, 64)]
    assert values == sorted(values, reverse=True)
    assert values[-1] < 2e-3  # both tend to uniform, KL shrinks like 1 / T**2


def test_teacher_with_minus_inf_logits_gives_finite_loss_and_grad() -> None:
    teacher = torch.tensor([[2.0, -math.inf, 0.5, -math.inf], [-math.inf, 1.0, -math.inf, 0.0]])
    student = torch.randn(2, 4, requires_grad=True)
    for kind in losses.DIVERGENCES:
        value = losses.divergence(kind, student, teacher, temperature=2.0)
        assert torch.isfinite(value), kind
        (gradient,) = torch.autograd.grad(value, student)
        assert torch.isfinite(gradient).all(), kind
    # forward KL ignores zero-probability teacher tokens exactly
    p = softmax([2.0, 0.5])
    q_full = softmax(student[0].tolist())
    q = [q_full[0], q_full[2]]
    expected = sum(x * math.log(x / y) for x, y in zip(p, q))
    assert losses.forward_kl(student[0], teacher[0]).item() == pytest.approx(expected, abs=1e-5)


def test_reverse_kl_penalises_mass_on_teacher_zeros() -> None:
    teacher = torch.tensor([0.0, -math.inf])
    on_support = losses.reverse_kl(torch.tensor([10.0, -10.0]), teacher).item()
    off_support = losses.reverse_kl(torch.tensor([0.0, 0.0]), teacher).item()
    assert math.isfinite(off_support)
    assert off_support > 10 * max(on_support, 1e-3)


@pytest.mark.parametrize("kind", losses.DIVERGENCES)
def test_gradient_flows_only_into_student(kind: str) -> None:
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(3, 7, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 7, generator=generator, requires_grad=True)
    losses.divergence(kind, student, teacher, temperature=1.5).backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_feature_regression_detaches_target_and_matches_smooth_l1() -> None:
    predicted = torch.tensor([[0.0, 0.0], [3.0, 0.5]], requires_grad=True)
    target = torch.tensor([[0.5, -2.0], [0.0, 0.5]], requires_grad=True)
    # smooth L1 (beta 1): 0.5 d^2 if |d| < 1 else |d| - 0.5
    row0 = (0.5 * 0.25 + (2.0 - 0.5)) / 2
    row1 = ((3.0 - 0.5) + 0.0) / 2
    value = losses.feature_regression(predicted, target)
    assert value.item() == pytest.approx((row0 + row1) / 2)
    masked = losses.feature_regression(predicted, target, mask=torch.tensor([True, False]))
    assert masked.item() == pytest.approx(row0)
    masked.backward()
    assert target.grad is None and predicted.grad is not None
    with pytest.raises(ValueError, match="same shape"):
        losses.feature_regression(predicted, target[:, :1])


def test_mask_excludes_positions() -> None:
    student = torch.stack([logits_of(Q), torch.tensor([50.0, -50.0, 0.0])])
    teacher = torch.stack([logits_of(P), torch.tensor([-50.0, 50.0, 0.0])])
    per_position = losses.forward_kl(student, teacher)
    masked = losses.divergence("fkl", student, teacher, mask=torch.tensor([True, False]))
    assert masked.item() == pytest.approx(per_position[0].item(), abs=1e-6)
    unmasked = losses.divergence("fkl", student, teacher)
    assert unmasked.item() == pytest.approx(per_position.mean().item(), abs=1e-5)
    integer_mask = losses.divergence("fkl", student, teacher, mask=torch.tensor([0, 1]))
    assert integer_mask.item() == pytest.approx(per_position[1].item(), abs=1e-4)
    empty = losses.divergence("fkl", student, teacher, mask=torch.tensor([False, False]))
    assert empty.item() == 0.0


def test_divergence_dispatch_matches_functions() -> None:
    generator = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(2, 3, 9, generator=generator), torch.randn(2, 3, 9, generator=generator)
    for kind, function in LOSS_FUNCTIONS.items():
        expected = function(student, teacher, temperature=0.7).mean()
        assert losses.divergence(kind, student, teacher, temperature=0.7).item() == pytest.approx(
            expected.item(), abs=1e-6
        )
    jsd_beta = losses.jsd(student, teacher, beta=0.3).mean().item()
    assert losses.divergence("jsd", student, teacher, beta=0.3).item() == pytest.approx(jsd_beta)


def test_half_precision_inputs_give_float32() -> None:
    student = torch.randn(2, 5).to(torch.bfloat16)
    assert losses.forward_kl(student, student.clone()).dtype == torch.float32


def test_head_loss_weights() -> None:
    assert losses.head_loss_weights(4) == pytest.approx([1.0, 0.8, 0.64, 0.512])
    assert losses.head_loss_weights(2, decay=0.5) == [1.0, 0.5]
    with pytest.raises(ValueError, match="num_heads"):
        losses.head_loss_weights(0)
    with pytest.raises(ValueError, match="decay"):
        losses.head_loss_weights(3, decay=0.0)


def test_bad_inputs_raise() -> None:
    a, b = torch.zeros(2, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"kind.*fkl.*rkl.*jsd.*tvd.*ce.*'kld'"):
        losses.divergence("kld", a, b)
    for temperature in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature"):
            losses.divergence("fkl", a, b, temperature=temperature)
    with pytest.raises(ValueError, match="same shape"):
        losses.forward_kl(a, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="mask"):
        losses.divergence("tvd", a, b, mask=torch.ones(3, dtype=torch.bool))
    for beta in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="beta"):
            losses.jsd(a, b, beta=beta)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_every_divergence_at_the_serving_temperature_hand_computed(temperature: float) -> None:
    """What DistillSpec distils with: each divergence between the two distributions softened by the
    serving temperature, JSD(beta) with beta the target's weight, masked means over positions."""
    student, teacher, beta = [1.0, -0.5, 0.3, 2.0], [0.2, 1.5, -1.0, 0.0], 0.3
    p = softmax([v / temperature for v in teacher])
    q = softmax([v / temperature for v in student])
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    expected = {
        "fkl": kl(p, q), "rkl": kl(q, p), "jsd": beta * kl(p, m) + (1 - beta) * kl(q, m),
        "tvd": 0.5 * sum(abs(x - y) for x, y in zip(p, q)), "ce": -sum(x * math.log(y) for x, y in zip(p, q)),
    }
    alpha = sum(min(x, y) for x, y in zip(p, q))
    expected["nla"] = -math.log(alpha)
    blend = math.exp(-3.0 * alpha)  # one position unmasked: its own overlap sets the blend
    expected["lk_hybrid"] = blend * kl(p, q) + (1 - blend) * (1 - alpha)
    # a second position, masked out, must not count
    students = torch.tensor([student, [9.0, 0.0, 0.0, 0.0]])
    teachers = torch.tensor([teacher, [0.0, 0.0, 0.0, 9.0]])
    mask = torch.tensor([True, False])
    for kind, value in expected.items():
        got = losses.divergence(kind, students, teachers, temperature=temperature, beta=beta, mask=mask)
        assert got.item() == pytest.approx(value, abs=1e-6), kind


# Acceptance objectives. Hand-computed: P = [0.5, 0.25, 0.25] (teacher), Q = [0.25, 0.5, 0.25]
# (student): min = [0.25, 0.25, 0.25], alpha = 0.75, TV = 0.25 = 1 - alpha.
P2 = [0.9, 0.05, 0.05]  # a second position: with Q2 the overlap is 0.4 + 0.05 + 0.05 = 0.5
Q2 = [0.4, 0.4, 0.2]


def test_acceptance_overlap_and_total_variation_hand_computed() -> None:
    assert losses.acceptance_overlap(logits_of(Q), logits_of(P)).item() == pytest.approx(0.75)
    assert losses.acceptance_overlap(logits_of(Q2), logits_of(P2)).item() == pytest.approx(0.5)
    assert losses.total_variation(logits_of(Q), logits_of(P)).item() == pytest.approx(1 - 0.75)
    assert losses.total_variation(logits_of(Q2), logits_of(P2)).item() == pytest.approx(1 - 0.5)
    # disjoint supports: nothing is ever accepted
    assert losses.acceptance_overlap(logits_of([0.0, 1.0]), logits_of([1.0, 0.0])).item() == 0.0


def test_negative_log_acceptance_hand_computed_and_gradient() -> None:
    assert losses.negative_log_acceptance(logits_of(Q), logits_of(P)).item() == pytest.approx(-math.log(0.75))
    assert losses.negative_log_acceptance(logits_of(Q2), logits_of(P2)).item() == pytest.approx(math.log(2))
    # -log(alpha)'s gradient is TV's (= -grad alpha) scaled by 1 / alpha
    student = logits_of(Q2).requires_grad_()
    (nla_gradient,) = torch.autograd.grad(losses.negative_log_acceptance(student, logits_of(P2)), student)
    (tv_gradient,) = torch.autograd.grad(losses.total_variation(student, logits_of(P2)), student)
    torch.testing.assert_close(nla_gradient, tv_gradient / 0.5)
    disjoint = losses.negative_log_acceptance(logits_of([0.0, 1.0]), logits_of([1.0, 0.0])).item()
    assert math.isfinite(disjoint) and disjoint > 80


def test_lk_hybrid_one_blend_per_call_from_the_masked_mean_overlap() -> None:
    students = torch.stack([logits_of(Q), logits_of(Q2)])
    teachers = torch.stack([logits_of(P), logits_of(P2)])
    kls, overlaps = [kl(P, Q), kl(P2, Q2)], [0.75, 0.5]
    blend = math.exp(-3.0 * (0.75 + 0.5) / 2)  # the mean overlap of both positions
    expected = [blend * k + (1 - blend) * (1 - a) for k, a in zip(kls, overlaps)]
    per_position = losses.lk_hybrid(students, teachers)
    assert per_position.tolist() == pytest.approx(expected, abs=1e-6)
    assert losses.divergence("lk_hybrid", students, teachers).item() == pytest.approx(sum(expected) / 2, abs=1e-6)
    # masking the second position: the blend comes from the first alone, and only it counts
    mask = torch.tensor([True, False])
    blend = math.exp(-3.0 * 0.75)
    masked = losses.divergence("lk_hybrid", students, teachers, mask=mask).item()
    assert masked == pytest.approx(blend * kls[0] + (1 - blend) * 0.25, abs=1e-6)
    # eta 0: forward KL; a large eta: total variation
    assert losses.lk_hybrid(students, teachers, eta=0.0).tolist() == pytest.approx(kls, abs=1e-6)
    assert losses.lk_hybrid(students, teachers, eta=200.0).tolist() == pytest.approx([0.25, 0.5], abs=1e-6)
    for eta in (-1.0, math.nan, True):
        with pytest.raises(ValueError, match="eta"):
            losses.lk_hybrid(students, teachers, eta=eta)


def test_lk_hybrid_blend_is_detached() -> None:
    """The gradient is blend x grad KL + (1 - blend) x grad TV with the blend held constant."""
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(4, 6, generator=generator, requires_grad=True)
    teacher = torch.randn(4, 6, generator=generator)
    blend = math.exp(-3.0 * losses.acceptance_overlap(student, teacher).mean().item())
    (hybrid,) = torch.autograd.grad(losses.divergence("lk_hybrid", student, teacher), student)
    (forward,) = torch.autograd.grad(losses.divergence("fkl", student, teacher), student)
    (variation,) = torch.autograd.grad(losses.divergence("tvd", student, teacher), student)
    torch.testing.assert_close(hybrid, blend * forward + (1 - blend) * variation)
