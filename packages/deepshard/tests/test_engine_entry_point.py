"""`import deepshard.engine as ds` reaches the foundation's public names."""

from __future__ import annotations

from importlib.metadata import version

import deepshard.accelerators
import deepshard.comm
import deepshard.engine as ds
import deepshard.interface


def test_version_is_the_distribution_version() -> None:
    assert ds.__version__ == version("deepshard") == version("deepshard-interface")


def test_entry_point_re_exports_are_the_package_objects() -> None:
    assert ds.DeepShardConfig is deepshard.interface.DeepShardConfig
    assert ds.Topology is deepshard.interface.Topology
    assert ds.init_distributed is deepshard.comm.init_distributed
    assert ds.build_mesh is deepshard.comm.build_mesh
    assert ds.get_accelerator is deepshard.accelerators.get_accelerator
    assert issubclass(ds.ConfigError, ds.DeepShardError)
    assert set(ds.__all__) <= set(dir(ds))
