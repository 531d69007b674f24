"""The process cap trusts only real cgroups (rlkit/sandbox/containment.py, rlkit/sandbox/reaper.py): it makes its
cgroups only on a mounted cgroup file system with the pids controller (never cgroup v1's /sys/fs/cgroup, a
writable tmpfs), names them after its maker's pid namespace, pid and start time, says so when it cannot make
one, and signals only pids read from a real cgroup. The mounts are faked here (reaper.MOUNTINFO,
containment.PROC_CGROUP point at files of the test), as the machine's cgroup layout is what it is."""

import itertools
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlkit.sandbox import containment, reaper
from rlkit.sandbox.containment import ProcessCap, sweep_stale_cgroups
from rlkit.sandbox.reaper import kill_cgroup, remove_cgroup

pytestmark = pytest.mark.slow  # starts processes in cgroups


def _mountinfo(tmp_path, *mounts):
    """A mountinfo file: (mount point, fs type, super options) each, as the kernel writes them."""
    lines = [f"{30 + i} 23 0:{40 + i} / {point} rw,relatime - {fstype} {fstype} {options}"
             for i, (point, fstype, options) in enumerate(mounts)]  # fmt: skip
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Point the cap at a fake mount table; returns a function (mounts, /proc/self/cgroup text) -> None."""

    def use(mounts, proc_cgroup):
        monkeypatch.setattr(reaper, "MOUNTINFO", str(_mountinfo(tmp_path, *mounts)))
        (tmp_path / "proc_cgroup").write_text(proc_cgroup)
        monkeypatch.setattr(containment, "PROC_CGROUP", str(tmp_path / "proc_cgroup"))

    monkeypatch.setattr(containment, "_SWEPT", [True])  # no sweep of the machine's cgroups from these tests
    monkeypatch.setattr(containment, "_SAID", [False])
    return use


def _start_time_of_self() -> int:
    """Field 22 of /proc/self/stat (starttime), counted from the front past the command's parentheses."""
    text = Path("/proc/self/stat").read_text()
    after = text[text.rindex(")") + 2 :].split(" ")  # field 3 (state) onwards
    return int(after[22 - 3])


def test_a_tmpfs_under_sys_fs_cgroup_is_never_a_cap_and_the_fallback_says_so(tmp_path, fake, caplog):
    """cgroup v1's /sys/fs/cgroup is a writable tmpfs: before, the cap fell back to it when the pids hierarchy's
    name was taken, made `pids.max` and `cgroup.procs` there as plain files and ran the batch uncontained."""
    root = tmp_path / "cg"
    (root / "pids").mkdir(parents=True)
    (root / "memory").mkdir()
    # a tmpfs at cg, a v1 memory hierarchy under it, the pids "hierarchy" only a folder of the tmpfs; no cgroup2
    fake(
        [(root, "tmpfs", "rw,mode=755"), (root / "memory", "cgroup", "rw,memory")],
        "8:pids:/\n4:memory:/\n0::/\n",
    )
    assert containment._pids_cgroup_roots() == []
    with caplog.at_level(logging.WARNING, logger="rlkit.sandbox.containment"):
        cap = ProcessCap(8)
        ProcessCap(8).close()  # a second cap: no second line
    try:
        assert cap.path is None and cap.counting and cap.cgroup_for(0) is None
    finally:
        cap.close()
    said = [r.getMessage() for r in caplog.records if "no pids cgroup can be made here" in r.getMessage()]
    assert len(said) == 1, said
    assert "counts the workers' process groups" in said[0]
    made = [p for p in root.rglob("*")]
    assert sorted(p.name for p in made) == ["memory", "pids"]  # nothing was created in the tmpfs


def test_a_cap_on_a_real_pids_mount_is_named_after_its_maker_and_never_takes_an_existing_name(
    tmp_path, fake, monkeypatch
):
    """The name holds the pid namespace, pid and start time of its maker (a pid reused later has another start
    time); a name that exists already is left as it is (its pids.max untouched) and the next real root is used."""
    v1, v2 = tmp_path / "cg" / "pids", tmp_path / "cg" / "unified"
    (v1 / "job").mkdir(parents=True)
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cgroup.controllers").write_text("cpu memory pids\n")
    fake(
        [(tmp_path / "cg", "tmpfs", "rw"), (v1, "cgroup", "rw,pids"), (v2, "cgroup2", "rw,nsdelegate")],
        "9:pids:/job\n1:name=systemd:/\n0::/job\n",
    )
    assert containment._pids_cgroup_roots() == [str(v1 / "job"), str(v2 / "job")]
    namespace = os.stat("/proc/self/ns/pid").st_ino
    expected = f"rlkit-{namespace}-{os.getpid()}-{_start_time_of_self()}-7"
    monkeypatch.setattr(containment, "_SEQ", itertools.count(7))
    (v1 / "job" / expected).mkdir()
    (v1 / "job" / expected / "pids.max").write_text("someone else's\n")
    cap = ProcessCap(8)
    try:
        assert cap.path == str(v2 / "job" / expected)
        assert (v2 / "job" / expected / "pids.max").read_text() == "8"
        assert (v1 / "job" / expected / "pids.max").read_text() == "someone else's\n"  # untouched
    finally:
        cap.close()
    # cgroup2 without the pids controller offered: no root there
    (v2 / "job" / "cgroup.controllers").write_text("cpu memory\n")
    assert containment._pids_cgroup_roots() == [str(v1 / "job")]


def test_nothing_is_signalled_from_a_folder_that_only_looks_like_a_cgroup(tmp_path, fake):
    """Before, a folder left in the tmpfs with a `cgroup.procs` file was swept by every later start-up, which
    SIGKILLed the pids listed in it: an unrelated process died. Now a pid is signalled only when it was read
    from a cgroup on a pids cgroup file system, and the sweep looks only there."""
    root = tmp_path / "cg"
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
        looks = root / f"rlkit-{namespace}-999999999-1-0"  # a maker that cannot be alive
        (looks / "w0").mkdir(parents=True)
        for folder in (looks, looks / "w0"):
            (folder / "cgroup.procs").write_text(f"{sleeper.pid}\n")
        fake([(root, "tmpfs", "rw,mode=755")], "8:pids:/\n0::/\n")
        assert sweep_stale_cgroups() == []
        kill_cgroup(str(looks))
        remove_cgroup(str(looks / "w0"))
        remove_cgroup(str(looks))
        time.sleep(0.3)
        assert sleeper.poll() is None  # not signalled
        assert (looks / "w0" / "cgroup.procs").exists() and not (looks / "pids.max").exists()
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


def test_mount_points_with_escaped_characters_are_read_back():
    """mountinfo writes a space in a path as \\040: the mount is still found."""
    assert reaper._unescape("/sys/fs/my\\040cgroup") == "/sys/fs/my cgroup"
