"""The fake-mesh writer: DTensors made without importing torch._dynamo, and torch's own path restored after."""

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")

SCRIPT = textwrap.dedent(
    """
    import io, sys
    import torch
    from ckptshard.write.dtensor_mesh import dtensor_of, fake_mesh, sharded_tensor_of

    with fake_mesh(3, 1) as mesh:
        d = dtensor_of(torch.arange(8.0).reshape(4, 2), mesh, (10, 2), (("shard", 0),))
        buf = io.BytesIO()
        torch.save({"w": d}, buf)
        during = "torch._dynamo" in sys.modules
    init = torch.distributed.tensor.DTensor.__init__
    left = "__dynamo_disable" in init.__wrapped__.__dict__
    with fake_mesh(2, 0, dtensors=False) as mesh:
        sharded_tensor_of(torch.zeros(3, 2), mesh, (5, 2), (("shard", 0),))
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    print(during, left, tuple(back["w"].shape), back["w"].to_local().tolist() == d.to_local().tolist())
    """
)


def test_dtensors_written_without_importing_dynamo_and_nothing_left_behind() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "(10,", "2)", "True"], out


FSDP1_ONLY = textwrap.dedent(
    """
    import sys
    import torch
    from ckptshard.write.dtensor_mesh import fake_mesh, sharded_tensor_of

    with fake_mesh(2, 1, dtensors=False) as mesh:
        st = sharded_tensor_of(torch.zeros(2, 2), mesh, (5, 2), (("shard", 0),))
    print("torch.distributed.tensor" in sys.modules, [s.tensor.shape[0] for s in st.local_shards()])
    """
)


def test_sharded_tensors_leave_dtensor_unimported() -> None:
    out = subprocess.run([sys.executable, "-c", FSDP1_ONLY], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "[2]"], out
