"""Triton's kernel cache on a network filesystem is found and warned about, once.

The mount table and ``df`` outputs are excerpts of the shapes seen on real machines (an NFS
home, a long device name that plain ``df -T`` wraps onto its own line, a CIFS share with spaces,
an escaped mount point, a later mount hiding an earlier one), so no NFS server is needed.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest

from deepshard.kernels import _cache_dir
from deepshard.kernels._cache_dir import (
    filesystem_type,
    is_network_filesystem,
    parse_df,
    parse_mountinfo,
    triton_cache_dir,
    warn_if_network_cache,
)

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 0:40 / /home rw,relatime shared:5 - nfs4 fileserver:/export/home rw,vers=4.2
31 30 0:41 / /home/alice/scratch\\040space rw,relatime - xfs /dev/nvme0n1p1 rw
32 22 0:42 / /mnt/data rw - lustre 10.0.0.1@tcp:/fs rw
33 22 0:43 / /mnt/data rw - ext4 /dev/vdb1 rw
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/alice/.triton/cache", "nfs4"),
        ("/home", "nfs4"),
        ("/homework", "ext4"),  # a prefix of the string, not of the path
        ("/home/alice/scratch space/triton", "xfs"),  # \040 in the table is a space
        ("/mnt/data/triton", "ext4"),  # the later mount on /mnt/data hides the lustre one
        ("/tmp", "ext4"),
    ],
)
def test_the_mount_holding_a_path_is_the_longest_covering_mount_point(
    path: str, expected: str
) -> None:
    assert parse_mountinfo(MOUNTINFO, path) == expected


DF_POSIX = """\
Filesystem     Type 1024-blocks      Used Available Capacity Mounted on
fileserver:/export/home nfs4 104857600 52428800 52428800      50% /home
"""
DF_WRAPPED = """\
Filesystem                                         Type  1K-blocks     Used Available Use% Mounted on
very-long-storage-server.cluster.example:/exports/home/research
                                                   nfs   104857600 52428800  52428800  50% /home
"""  # noqa: E501  (plain `df -T` puts a long device name on a line of its own)
DF_SPACES = """\
Filesystem               Type 1024-blocks   Used Available Capacity Mounted on
//nas/team share          cifs   2097152  1048576   1048576      50% /mnt/team drive
"""


@pytest.mark.parametrize(
    ("output", "expected"), [(DF_POSIX, "nfs4"), (DF_WRAPPED, "nfs"), (DF_SPACES, "cifs")]
)
def test_df_output_is_parsed_from_the_capacity_column(output: str, expected: str) -> None:
    assert parse_df(output) == expected


@pytest.mark.parametrize("output", ["", "df: /x: No such file or directory\n", "Filesystem\n"])
def test_df_output_of_another_shape_is_unknown(output: str) -> None:
    assert parse_df(output) is None


def test_without_mountinfo_df_is_run_on_the_nearest_existing_folder(tmp_path: Path) -> None:
    ran: list[list[str]] = []

    def fake_df(command: list[str]) -> str:
        ran.append(command)
        return DF_WRAPPED

    missing = tmp_path / "not" / "yet" / "made"
    found = filesystem_type(missing, mountinfo=tmp_path / "no-mountinfo", run=fake_df)
    assert found == "nfs"
    assert ran == [["df", "-PT", str(tmp_path.resolve())]]  # Triton creates the rest later


def test_a_df_that_cannot_run_gives_unknown(tmp_path: Path) -> None:
    def broken(command: list[str]) -> str:
        raise subprocess.CalledProcessError(1, command)

    def absent(command: list[str]) -> str:
        raise FileNotFoundError("df")

    for run in (broken, absent):
        assert filesystem_type(tmp_path, mountinfo=tmp_path / "none", run=run) is None


def test_the_cache_folder_is_resolved_as_triton_resolves_it(tmp_path: Path) -> None:
    assert triton_cache_dir({"TRITON_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert triton_cache_dir({"TRITON_HOME": str(tmp_path)}) == tmp_path / ".triton" / "cache"
    assert triton_cache_dir({}) == Path.home() / ".triton" / "cache"


def test_network_types_are_recognised_and_local_ones_are_not() -> None:
    for kind in ("nfs", "NFS4", "nfsd", "lustre", "gpfs", "cifs", "fuse.sshfs", "beegfs"):
        assert is_network_filesystem(kind), kind
    for kind in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "apfs", None, ""):
        assert not is_network_filesystem(kind), kind


def test_a_network_cache_warns_once_naming_the_folder_and_the_fix(tmp_path: Path) -> None:
    _cache_dir._warn_once.cache_clear()
    env = {"TRITON_CACHE_DIR": str(tmp_path / "shared")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_if_network_cache(env, lookup=lambda _: "nfs4") == "nfs4"
        assert warn_if_network_cache(env, lookup=lambda _: "nfs4") == "nfs4"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert str(tmp_path / "shared") in messages[0] and "nfs4" in messages[0]
    assert "TRITON_CACHE_DIR" in messages[0]


def test_a_local_or_unknown_cache_does_not_warn(tmp_path: Path) -> None:
    _cache_dir._warn_once.cache_clear()
    env = {"TRITON_CACHE_DIR": str(tmp_path)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_network_cache(env, lookup=lambda _: "ext4") == "ext4"
        assert warn_if_network_cache(env, lookup=lambda _: None) is None


def test_this_machine_s_temporary_folder_has_a_filesystem_type(tmp_path: Path) -> None:
    # The real lookup (mountinfo on Linux, df elsewhere) finds some type for an existing folder.
    found = filesystem_type(tmp_path)
    assert found is None or (isinstance(found, str) and found.strip() == found and found)
    if Path("/proc/self/mountinfo").exists():
        assert found  # Linux always lists the mount holding a folder that exists


def test_loading_the_triton_kernels_checks_the_cache_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from deepshard.kernels import _weighted_sum

    checked: list[bool] = []
    monkeypatch.setattr(_weighted_sum, "warn_if_network_cache", lambda: checked.append(True))
    module = _weighted_sum._triton_kernels.__wrapped__()  # the uncached body
    assert module is not None and hasattr(module, "forward")
    assert checked == [True]
