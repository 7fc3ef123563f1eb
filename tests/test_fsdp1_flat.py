"""FSDP1's flat-parameter arithmetic (use_orig_params), worked by hand; the real runs are in
test_torch_fsdp_files.py."""

from ckptshard.layout.fsdp1_flat import FlatUnits, find_units, flat_offsets, group, param_slices, same_at


def test_each_parameter_is_aligned_then_the_unit_is_cut_in_equal_shards():
    # 2 elements at 0; 30 at 4 (2 padded to 4); 7 at 36 (34 padded to 36): 43 elements, 15 per rank at 3.
    assert flat_offsets([2, 30, 7], 4) == ([0, 4, 36], 43)
    assert flat_offsets([2, 30, 7], 8) == ([0, 8, 40], 47)
    assert param_slices(4, 30, 15) == {0: (0, 11), 1: (11, 15), 2: (26, 4)}
    units = FlatUnits(((0, 1, 2),), 4, ())
    assert units.slices([2, 30, 7], 3) == [{0: (0, 2)}, {0: (0, 11), 1: (11, 15), 2: (26, 4)}, {2: (0, 7)}]


def test_a_parameter_belongs_to_its_deepest_wrapped_module():
    names = ["gate", "embed.weight", "blocks.0.up.weight", "blocks.0.up.bias", "blocks.1.up.weight", "norm.weight"]
    assert group(names, ()) == ((0, 1, 2, 3, 4, 5),)
    assert group(names, ("blocks.*",)) == ((0, 1, 5), (2, 3), (4,))
    assert group(names, ("blocks.*", "blocks.*.up")) == ((0, 1, 5), (2, 3), (4,))


def test_the_slices_of_one_world_size_tell_the_wrapping_and_one_rank_tells_nothing():
    names = ["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]
    numels = [10, 6, 6, 3]
    wrapped = FlatUnits(group(names, ("layers.*",)), 4, ("layers.*",))
    seen = wrapped.slices(numels, 2)
    found = find_units(names, numels, seen, 2)
    assert found and all(f.slices(numels, 5) == wrapped.slices(numels, 5) for f in found)
    assert same_at(found, numels, 5) is not None
    assert find_units(names, numels, [{0: (0, 10)}, {1: (0, 6)}, {0: (0, 6)}, {1: (0, 3)}], 2) == []
    one = find_units(names, numels, FlatUnits(((0, 1, 2, 3),), 4, ()).slices(numels, 1), 1)
    assert len(one) > 1 and same_at(one, numels, 2) is None
