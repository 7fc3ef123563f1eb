"""Matching an optimizer's parameters to state-dict entries by order and shape (FSDP1 at world size 1)."""

from ckptshard.layout.param_order import match_in_order


def test_buffers_and_a_trailing_tie_are_passed_over() -> None:
    have = [(1, 6), (2,), (5,), (13, 6), (7, 6), (7,), (6,), (6,), (13, 6)]  # buffer (5,), tie (13, 6) last
    m = match_in_order([(1, 6), (2,), (13, 6), (7, 6), (7,), (6,), (6,)], have)
    assert (m.ways, m.picked) == (1, [0, 1, 3, 4, 5, 6, 7])


def test_a_buffer_shaped_like_its_neighbour_is_ambiguous() -> None:
    m = match_in_order([(4,), (3,)], [(4,), (4,), (3,)])
    assert (m.ways, m.picked, m.fork) == (2, None, 0)


def test_no_fit() -> None:
    assert match_in_order([(4,), (3,)], [(3,), (4,)]).ways == 0
    assert match_in_order([(4,), (3,)], [(4,)]).ways == 0


def test_a_parameter_without_state_fits_any_entry_but_one_answer_still_wins() -> None:
    assert match_in_order([None, (3,)], [(9,), (3,)]).picked == [0, 1]
    m = match_in_order([None, (3,)], [(9,), (8,), (3,)])  # the stateless one: entry 0 or 1
    assert (m.ways, m.fork) == (2, 0)


def test_every_entry_a_parameter() -> None:
    shapes = [(i % 3 + 1,) for i in range(50)]
    assert match_in_order(shapes, shapes).picked == list(range(50))
