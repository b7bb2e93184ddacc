"""Evaluation metrics over sampled answers.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex): from n samples of which c are
correct, the probability that at least one of k samples drawn without replacement is correct,
1 - C(n-c, k) / C(n, k). It is computed as a product of k ratios rather than from binomials, which
overflow floats (C(1000, 500) ~ 1e299) and are slow as exact integers.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct. Returns a float in [0, 1].

    Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # fewer than k wrong samples: every k-subset holds a correct one
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): each factor is in (0, 1], no overflow.
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """Mean of :func:`pass_at_k` over problems given as ``(n, c)`` pairs.

    Raises ValueError on an empty list or on any invalid pair.
    """
    if not counts:
        raise ValueError("mean_pass_at_k: no problems given")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
