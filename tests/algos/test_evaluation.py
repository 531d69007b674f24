"""rlkit.algos.evaluation against naive counts: pass@k by enumerating every k-subset, maj@k by hand, the
standard error by its formula written out."""

import itertools
import math

import pytest
import torch

from rlkit.algos.evaluation import (
    maj_at_k,
    majority_vote,
    mean_and_spread,
    paired_difference,
    pass_at_k,
    stderr,
)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


CASES = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]


@pytest.mark.parametrize("n,c,k", CASES)
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample(n, c, k):
    got = float(pass_at_k([n], [c], k)[0])
    assert got == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edge_cases_by_hand():
    # c = 0: never; c = n: always; k = n: any correct; k = 1: c / n
    assert pass_at_k([5, 5, 5, 5], [0, 5, 1, 2], 5).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert pass_at_k([4, 4, 4], [0, 1, 3], 1).tolist() == pytest.approx([0.0, 0.25, 0.75])
    # 1 of 4 correct, k = 2: 1 - C(3,2)/C(4,2) = 1 - 3/6 (verl's best@N was biased low on such a case)
    assert float(pass_at_k([4], [1], 2)[0]) == pytest.approx(0.5)
    # different n per prompt
    assert pass_at_k([2, 6], [1, 0], 2).tolist() == pytest.approx([1.0, 0.0])


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form does not. 1 - C(990, 10)/C(1000, 10) by logs:
    exact = 1 - math.exp(math.lgamma(991) - math.lgamma(981) - math.lgamma(1001) + math.lgamma(991))
    assert float(pass_at_k([1000], [10], 10)[0]) == pytest.approx(exact, rel=1e-9)
    assert 0.0 <= float(pass_at_k([1000], [3], 500)[0]) <= 1.0


def test_pass_at_k_rejects_k_above_n_and_bad_counts():
    with pytest.raises(ValueError, match="k=3 is larger"):
        pass_at_k([2], [1], 3)
    with pytest.raises(ValueError, match=r"\[0, n\]"):
        pass_at_k([2], [3], 1)
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k([2], [1], 0)


def test_majority_vote_ties_go_to_the_answer_seen_first_and_none_does_not_vote():
    assert majority_vote(["7", "8", "8", "7"]) == 0  # 2-2 tie: "7" appears first
    assert majority_vote(["8", "7", "7", None, None, None]) == 1  # None never wins however many
    assert majority_vote([None, None]) is None
    assert majority_vote(["a", "b", "c"]) == 0


def test_maj_at_k_against_a_hand_count():
    answers = [
        ["12", "13", "13", "12", "12"],  # first 3: 13 wins (2 votes); all 5: 12 wins (3 votes)
        ["5", "6", "6", "5", "6"],  # first 2: tie 5/6 -> 5 (first); first 4: tie -> 5; all 5: 6
        [None, None, "1", "1", "1"],  # first 2: nobody voted -> 0
    ]
    right = {0: "12", 1: "6", 2: "1"}
    correct = [[a == right[p] for a in row] for p, row in enumerate(answers)]
    assert maj_at_k(answers, correct, 1).tolist() == [1.0, 0.0, 0.0]
    assert maj_at_k(answers, correct, 2).tolist() == [1.0, 0.0, 0.0]  # p0: tie 12/13 -> 12
    assert maj_at_k(answers, correct, 3).tolist() == [0.0, 1.0, 1.0]
    assert maj_at_k(answers, correct, 4).tolist() == [1.0, 0.0, 1.0]
    assert maj_at_k(answers, correct, 5).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="maj@6"):
        maj_at_k(answers, correct, 6)


def test_stderr_paired_difference_and_seed_spread_by_hand():
    v = [1.0, 0.0, 0.5, 0.5]
    mean = sum(v) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / 3)
    assert stderr(v) == pytest.approx(std / 2)
    assert math.isnan(stderr([1.0]))
    a, b = [0.0, 0.5, 1.0, 0.25], [0.5, 0.5, 1.0, 1.0]
    d = [0.5, 0.0, 0.0, 0.75]
    dm = sum(d) / 4
    ds = math.sqrt(sum((x - dm) ** 2 for x in d) / 3) / 2
    assert paired_difference(a, b) == pytest.approx((dm, ds))
    m, s = mean_and_spread([0.6, 0.7, 0.8])
    assert (m, s) == pytest.approx((0.7, 0.1))
    assert math.isnan(mean_and_spread([0.5])[1])
    # inputs untouched
    t = torch.tensor(v)
    stderr(t)
    assert t.tolist() == v
