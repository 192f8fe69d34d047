"""SIMD path discovery and forcing: available paths, use_simd_path, DEEPSHARD_CPU_SIMD."""

from __future__ import annotations

import os
import platform

import pytest

import deepshard.kernels as kernels
from deepshard.kernels import _extension

ALL_PATHS = ("scalar", "avx2", "avx512", "neon", "sve")


def test_available_paths_start_with_scalar_and_fit_the_machine():
    paths = kernels.available_simd_paths()
    assert paths[0] == "scalar"
    assert set(paths) <= set(ALL_PATHS)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert not {"neon", "sve"} & set(paths)
    if os.environ.get(_extension.SIMD_ENV_VAR) is None:
        assert kernels.active_simd_path() == paths[-1], "the best path is active by default"


def test_use_simd_path_switches_and_restores(simd_path):
    before = kernels.active_simd_path()
    with kernels.use_simd_path(simd_path):
        assert kernels.active_simd_path() == simd_path
    assert kernels.active_simd_path() == before


def test_use_simd_path_restores_after_an_error():
    before = kernels.active_simd_path()
    with pytest.raises(ZeroDivisionError), kernels.use_simd_path("scalar"):
        _ = 1 / 0
    assert kernels.active_simd_path() == before


def test_unknown_and_uncompiled_paths_are_refused():
    with pytest.raises(ValueError, match=r"unknown SIMD path 'avx9000'.*scalar"):
        kernels.use_simd_path("avx9000").__enter__()
    missing = [p for p in ALL_PATHS if p not in kernels.available_simd_paths()]
    if not missing:
        pytest.skip("every path is usable here")
    with pytest.raises(ValueError, match=rf"'{missing[0]}' is (not compiled|compiled but)"):
        kernels.use_simd_path(missing[0]).__enter__()


def test_env_var_picks_the_path_at_load():
    loader = _extension.cpu_loader("deepshard.kernels._cpu", env={"DEEPSHARD_CPU_SIMD": "scalar"})
    extension = loader.get()
    assert extension is not None and extension.active_path() == "scalar"


def test_env_var_naming_a_bad_path_is_an_error_naming_the_variable():
    loader = _extension.cpu_loader("deepshard.kernels._cpu", env={"DEEPSHARD_CPU_SIMD": "mmx"})
    with pytest.raises(ValueError, match=r"DEEPSHARD_CPU_SIMD='mmx'.*unknown SIMD path"):
        loader.get()
