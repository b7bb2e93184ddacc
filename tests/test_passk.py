"""pass@k oracles: small cases by hand, large ones against exact rational arithmetic."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from trainer.tools.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 is c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
        (5, 0, 3, 0.0),  # nothing correct
        (5, 5, 5, 1.0),
        (5, 4, 2, 1.0),  # only one wrong sample: any 2 include a correct one
        (3, 1, 3, 1.0),  # k = n: the one correct sample is always drawn
        (1000, 1, 1, 0.001),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(2000, 500, 100), (1000, 3, 500), (256, 128, 16), (1024, 1, 1)])
def test_pass_at_k_large_n_matches_exact_fraction(n, c, k):
    # math.comb and Fraction are exact: an oracle independent of the float product form.
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_rejects_invalid(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_at_k_is_monotone_in_k():
    values = [pass_at_k(16, 3, k) for k in range(1, 17)]
    assert values == sorted(values) and values[-1] == 1.0


def test_mean_pass_at_k():
    assert mean_pass_at_k([(4, 1), (5, 2)], 1) == pytest.approx((0.25 + 0.4) / 2)
    assert mean_pass_at_k([(4, 1), (4, 0), (4, 4)], 2) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError, match="k <= n"):
        mean_pass_at_k([(8, 1), (2, 1)], 4)
