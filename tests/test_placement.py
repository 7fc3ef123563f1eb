"""The shard-dimension rule told from a source's placements (``ckptshard.plan.placement``), pure."""

import pytest

from ckptshard.errors import CheckpointError
from ckptshard.plan.placement import choose_rule, rule_dim

# verl's rule at 3 ranks: (64, 12) -> 1, (12, 12) -> 0, (20, 12) -> 1, (12,) -> 0
VERL_AT_3 = [("embed", (64, 12), 1), ("q", (12, 12), 0), ("gate", (20, 12), 1), ("norm", (12,), 0)]
TORCH_AT_3 = [(n, s, 0) for n, s, _ in VERL_AT_3]


def test_rule_dims_are_torchs_and_verls():
    assert [rule_dim("divisible", s, 3, d) for _, s, d in VERL_AT_3] == [1, 0, 1, 0]
    assert [rule_dim("dim0", s, 3, d) for _, s, d in VERL_AT_3] == [0, 0, 0, 0]
    assert rule_dim("divisible", (7, 5), 3, 0) == 0  # no dimension divisible: Shard(0), as verl falls back
    assert rule_dim("keep", (7, 5), 3, 1) == 1


def test_the_one_rule_that_fits_is_taken():
    assert choose_rule(VERL_AT_3, 3, 2, None, "src") == "divisible"
    assert choose_rule(TORCH_AT_3, 3, 4, None, "src") == "dim0"


def test_both_rules_fitting_are_refused_only_where_they_differ_at_n():
    both = [("w", (8, 6), 0), ("b", (8,), 0)]  # at 2 ranks both rules say Shard(0)
    assert choose_rule(both, 2, 4, None, "src") == "dim0"  # and at 4 too
    with pytest.raises(CheckpointError, match=r"at 3 ranks they place w \(8, 6\) on Shard\(0\) or Shard\(1\)"):
        choose_rule(both, 2, 3, None, "src")
    assert choose_rule(both, 2, 3, "divisible", "src") == "divisible"


def test_placements_of_neither_rule_name_a_weight_for_each():
    odd = [("a", (5, 4), 1), ("b", (5, 4), 0)]  # a: not dim 0; b: verl would pick 1 at 2 ranks
    with pytest.raises(CheckpointError) as e:
        choose_rule(odd, 2, 3, None, "src")
    assert "divide): a (5, 4) is Shard(1), b (5, 4) is Shard(0);" in str(e.value) and "--placement keep" in str(e.value)
    with pytest.raises(CheckpointError, match=r"divide\): a \(6, 4\) is Shard\(1\); --placement keep"):
        choose_rule([("a", (6, 4), 1)], 2, 3, None, "src")  # fits neither rule by itself: named once
    with pytest.raises(CheckpointError, match="--placement 'rows': choose one of dim0, divisible, keep"):
        choose_rule(odd, 2, 3, "rows", "src")
