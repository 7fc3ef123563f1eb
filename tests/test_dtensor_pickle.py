"""FSDP2 files resharded without torch: the source's DTensor pickles rewritten for the new mesh.

tests/test_torch_fsdp_files.py compares every resharded DTensor, its mesh's
fields included, with the files FSDP2 at N saves itself. Here: no torch
import, the same objects as torch's own pickling of the same plan (the
fallback), and the mesh layouts the rewrite refuses.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest

import ckptshard
from ckptshard.dtypes import StoredDType
from ckptshard.formats.dtensor_pickle import DTensorWriter
from ckptshard.formats.torch_distributed import MeshPlace, PickledDTensor, TemplateTensor
from ckptshard.formats.torch_names import Global, NewObj
from ckptshard.formats.torch_pickle import Unsupported

GOLDEN = pathlib.Path(__file__).parent / "data" / "golden" / "fsdp2"  # real FSDP2 at 2, torch 2.13

NO_TORCH = textwrap.dedent(
    """
    import sys
    import ckptshard
    ckptshard.reshard(sys.argv[1], sys.argv[2], 3, progress=False)
    print("torch" in sys.modules)
    """
)


def test_reshard_of_fsdp2_files_does_not_import_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(GOLDEN), str(tmp_path / "out")], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False"], out.stderr
    assert len(list((tmp_path / "out").glob("model_world_size_3_rank_*.pt"))) == 3


@pytest.mark.parametrize("n", [1, 3, 4])
def test_rewritten_pickles_are_what_torch_pickles_for_the_same_plan(n, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.tensor")
    from ckptshard.testing import torch_fsdp_runs

    ckptshard.reshard(str(GOLDEN), str(tmp_path / "fast"), n, progress=False)

    def refuse(self, fill):
        raise Unsupported("test: let torch pickle it")

    monkeypatch.setattr(DTensorWriter, "__call__", refuse)
    ckptshard.reshard(str(GOLDEN), str(tmp_path / "torch"), n, progress=False)
    for kind in ("model", "optim"):
        for r in range(n):
            name = f"{kind}_world_size_{n}_rank_{r}.pt"
            got = torch.load(tmp_path / "fast" / name, weights_only=True)
            torch_fsdp_runs.assert_same_state(got, torch.load(tmp_path / "torch" / name, weights_only=True), name)
            if kind == "model":  # the mesh's own tensor: 0..n-1, as a live mesh of n ranks holds
                mesh = next(iter(v for v in got.values() if hasattr(v, "device_mesh"))).device_mesh
                assert mesh._rank_map.tolist() == list(range(n)) and mesh._rank == r, name


def test_a_mesh_the_rules_do_not_know_is_written_from_torchs_pickle_of_it(tmp_path, monkeypatch):
    """A mesh with fields no rule covers (a torch release not seen): torch pickles one empty DTensor on the
    output rank's mesh and every DTensor is written by it, the file laid out without torch; the same objects
    as torch's own pickling of every DTensor."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.tensor")
    import ckptshard.write.torch_file as torch_file
    from ckptshard.testing import torch_fsdp_runs

    def unknown(self, mesh):
        raise Unsupported("test: a DeviceMesh field without a rule")

    with monkeypatch.context() as m:
        m.setattr(DTensorWriter, "_mesh", unknown)
        m.setattr(torch_file, "_torch_skeleton", lambda *a: pytest.fail("a file laid out by torch"))
        ckptshard.reshard(str(GOLDEN), str(tmp_path / "templated"), 3, progress=False)

    def refuse(self, fill):
        raise Unsupported("test: let torch pickle it")

    monkeypatch.setattr(DTensorWriter, "__call__", refuse)
    ckptshard.reshard(str(GOLDEN), str(tmp_path / "torch"), 3, progress=False)
    for kind in ("model", "optim"):
        for r in range(3):
            name = f"{kind}_world_size_3_rank_{r}.pt"
            got = torch.load(tmp_path / "templated" / name, weights_only=True)
            torch_fsdp_runs.assert_same_state(got, torch.load(tmp_path / "torch" / name, weights_only=True), name)


def _mesh(**changes):
    state = {
        "_device_type": "cpu",
        "_layout": NewObj(
            Global.of("torch.distributed._mesh_layout", "_MeshLayout"),
            (),
            {
                "axes": (
                    NewObj(
                        Global.of("torch.distributed._mesh_layout", "_FlatLayout"), (), {"shape": (2,), "stride": (1,)}
                    ),
                )
            },
        ),
        "_rank_map": TemplateTensor((2,), StoredDType("int32"), True),
        "_mesh_dim_names": None,
        "_root_mesh": None,
        "_flatten_rank_map": (0, 1),
        "_thread_id": None,
        "_flatten_mapping": {},
        "_dim_group_names": ["0"],
        "_rank": 1,
        "_coordinate_on_dim": (1,),
        "_hash": 12345,
    }
    state.update(changes)
    return NewObj(Global.of("torch.distributed.device_mesh", "DeviceMesh"), (), state)


def test_a_1d_mesh_is_resized_and_its_rank_set():
    writer = DTensorWriter(MeshPlace(5, 3))
    made = writer._mesh(_mesh())
    assert made.state["_rank"] == 3 and made.state["_coordinate_on_dim"] == (3,)
    assert made.state["_flatten_rank_map"] == (0, 1, 2, 3, 4) and made.state["_hash"] is None
    assert made.state["_rank_map"].data == b"".join(i.to_bytes(4, "little") for i in range(5))
    assert made.state["_layout"].state["axes"][0].state == {"shape": (5,), "stride": (1,)}
    alone = DTensorWriter(MeshPlace(1, 0))._mesh(_mesh())  # torch drops a mode of size 1 from the layout
    assert alone.state["_layout"].state["axes"][0].state == {"shape": (), "stride": ()}
    assert writer._mesh(_mesh()) is not made and writer._mesh(m := _mesh()) is writer._mesh(m)  # one per template


@pytest.mark.parametrize("torch_24", [False, True])
def test_a_mesh_as_torch_2_6_pickles_it_is_resized_too(torch_24):
    state = {
        "device_type": "cpu",
        "mesh": TemplateTensor((2,), StoredDType("int32"), True),
        "mesh_dim_names": None,
        "_flatten_mesh_list": (0, 1),
        "_thread_id": None,
        "_dim_group_infos": [("ptd:0", [0, 1], "0")],
        "_coordinate_on_dim": [0],
        "_hash": 1,
    }
    if torch_24:  # 2.4 also records the mesh it was sliced from (None: a root mesh) and the creating thread
        state.update(_parent_mesh=None, _thread_id=140542229216128)
    made = DTensorWriter(MeshPlace(3, 2))._mesh(
        NewObj(Global.of("torch.distributed.device_mesh", "DeviceMesh"), (), state)
    )
    assert made.state["_dim_group_infos"] == [("ptd:0", [0, 1, 2], "0")] and made.state["_coordinate_on_dim"] == [2]
    assert made.state["_flatten_mesh_list"] == (0, 1, 2) and made.state["mesh"].shape == (3,)
    assert made.state["_thread_id"] == state["_thread_id"]  # kept: torch's own files keep the saver's
    assert ("_parent_mesh" in made.state) == torch_24 and made.state.get("_parent_mesh") is None
    state["_dim_group_infos"] = [("ptd:0", [0, 1], "0"), ("ptd:1", [0], "1")]  # two mesh dimensions
    with pytest.raises(Unsupported):
        DTensorWriter(MeshPlace(3, 2))._mesh(
            NewObj(Global.of("torch.distributed.device_mesh", "DeviceMesh"), (), state)
        )


@pytest.mark.parametrize(
    "changes",
    [
        {"_coordinate_on_dim": (1, 0)},  # a 2-D mesh (HSDP)
        {"_root_mesh": _mesh()},  # sliced from a bigger mesh
        {"_parent_mesh": _mesh()},  # the same, as torch 2.4 records it
        {"_flatten_rank_map": (2, 3)},  # not all ranks
        {"_rank_map": TemplateTensor((2, 2), StoredDType("int32"), True)},
        {"_some_new_field": 1},  # a torch release with a field not known here
    ],
)
def test_a_mesh_the_rewrite_does_not_know_is_left_to_torch(changes):
    with pytest.raises(Unsupported):
        DTensorWriter(MeshPlace(3, 0))._mesh(_mesh(**changes))


def test_a_dtensor_without_its_source_pickle_is_left_to_torch():
    class Fill:
        pickled = None
        sharded_tensor = False

    with pytest.raises(Unsupported, match="no source DTensor"):
        DTensorWriter(MeshPlace(3, 0))(Fill())
    dtensor = Global.of("torch.distributed.tensor", "DTensor")
    Fill.pickled = PickledDTensor((dtensor,), (None, {}))
    with pytest.raises(Unsupported, match="wrapper subclass call"):
        DTensorWriter(MeshPlace(3, 0))(Fill())
    Fill.pickled = PickledDTensor((dtensor, Global.of("torch", "float32"), (2,), (1,)), {"not": "(dict, slots)"})
    with pytest.raises(Unsupported, match="state"):
        DTensorWriter(MeshPlace(3, 0))(Fill())
