"""The analytic speedup bound (Leviathan et al.) against hand-computed values, and its edge cases."""

import math

import pytest

from benchmarks.analytic import alpha_from_counts, expected_tokens, speedup_bound


def test_expected_tokens_hand_computed():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25


def test_expected_tokens_edges():
    assert expected_tokens(1.0, 4) == 5.0  # every draft accepted: gamma + the bonus token
    assert expected_tokens(1, 7) == 8.0
    assert expected_tokens(0.0, 4) == 1.0  # nothing accepted: the target's own token only
    assert expected_tokens(0.9, 0) == 1.0  # no drafts
    assert expected_tokens(1 - 1e-12, 4) == pytest.approx(5.0, rel=1e-6)  # continuous at alpha -> 1


def test_speedup_bound_hand_computed():
    # Free drafts and a verify pass as cheap as one step: the bound is E[N].
    assert speedup_bound(0.8, 4, 1.0, 1.0, 0.0) == pytest.approx(3.3616)
    # T_target(1) = 200 ms, T_target(5) = 250 ms, T_draft = 50 ms: 3.3616 * 0.2 / (4 * 0.05 + 0.25).
    assert speedup_bound(0.8, 4, 0.2, 0.25, 0.05) == pytest.approx(3.3616 * 0.2 / 0.45)
    assert speedup_bound(0.8, 4, 0.2, 0.25, 0.05) == pytest.approx(1.494044, rel=1e-6)
    # The paper's form with c = T_draft / T_target(1) and verify = one step: (1 - a^(g+1)) / ((1 - a)(g c + 1)).
    a, g, c = 0.7, 3, 0.1
    assert speedup_bound(a, g, 1.0, 1.0, c) == pytest.approx((1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)))


def test_speedup_bound_edges():
    assert speedup_bound(1.0, 4, 0.2, 0.2, 0.0) == pytest.approx(5.0)
    assert speedup_bound(0.0, 4, 0.2, 0.3, 0.05) == pytest.approx(0.2 / 0.5)  # all rejected: a slowdown
    assert speedup_bound(0.5, 0, 0.2, 0.2, 0.05) == pytest.approx(1.0)  # gamma 0 is plain decoding


@pytest.mark.parametrize("alpha", [-0.1, 1.1, math.nan, math.inf])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(alpha, 4)


@pytest.mark.parametrize("gamma", [-1, 2.5])
def test_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        speedup_bound(0.5, gamma, 1.0, 1.0, 0.1)


def test_bad_times():
    with pytest.raises(ValueError):
        speedup_bound(0.5, 4, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError):
        speedup_bound(0.5, 4, 1.0, 1.0, -0.1)


def test_alpha_from_counts():
    assert alpha_from_counts(3, 4) == 0.75
    assert alpha_from_counts(0, 0) is None
    with pytest.raises(ValueError):
        alpha_from_counts(5, 4)
