import jax
import numpy as np
import pytest

from ulysses_jax import MESH_AXES, make_mesh


def test_axes_sizes_and_fill():
    mesh = make_mesh(fsdp=-1, sp=4)
    assert mesh.axis_names == MESH_AXES == ("data", "fsdp", "ring", "sp")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "ring": 1, "sp": 4}
    assert dict(make_mesh(data=2, fsdp=2, sp=2).shape) == {"data": 2, "fsdp": 2, "ring": 1, "sp": 2}
    assert dict(make_mesh(data=-1, fsdp=1, sp=2).shape) == {"data": 4, "fsdp": 1, "ring": 1, "sp": 2}
    assert dict(make_mesh(sp=2, devices=jax.devices()[:2]).shape) == {"data": 1, "fsdp": 1, "ring": 1, "sp": 2}
    assert dict(make_mesh(ring=2, sp=4).shape) == {"data": 1, "fsdp": 1, "ring": 2, "sp": 4}
    assert dict(make_mesh(ring=-1, fsdp=1, sp=2).shape) == {"data": 1, "fsdp": 1, "ring": 4, "sp": 2}


def test_sp_is_innermost():
    mesh = make_mesh(data=2, fsdp=2, sp=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # consecutive devices form an sp group
    assert ids[0, 0, 0].tolist() == [0, 1] and ids[0, 1, 0].tolist() == [2, 3] and ids[1, 0, 0].tolist() == [4, 5]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    # ring between fsdp and sp: sp groups of consecutive devices, ring neighbours one sp group apart
    ids = np.vectorize(lambda d: d.id)(make_mesh(fsdp=2, ring=2, sp=2).devices)
    assert ids[0, 0].tolist() == [[0, 1], [2, 3]] and ids[0, 1].tolist() == [[4, 5], [6, 7]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(data=1, fsdp=3, sp=2), r"data=1 x fsdp=3 x sp=2 multiply to 6 but there are 8 devices"),
        (dict(data=1, fsdp=-1, sp=3), r"multiply to 3, which does not divide the 8 devices"),
        (dict(data=-1, fsdp=-1, sp=2), r"only one mesh axis may be -1"),
        (dict(data=0, fsdp=-1, sp=2), r"data=0 must be a positive integer or -1"),
        (dict(fsdp=1, ring=3, sp=2), r"data=1 x fsdp=1 x ring=3 x sp=2 multiply to 6 but there are 8 devices"),
    ],
)
def test_bad_sizes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(**kwargs)
