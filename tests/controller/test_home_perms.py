"""RGT_HOME and the socket directories must be private: ours and 0700. One of ours that is too
open is tightened with one warning; one that is not ours (or a shared sticky dir) is refused."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from controller import paths
from controller.box import ssh
from controller.store.db import Store, StoreError

REPO = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def not_ours(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A uid other than ours owns directories made through `made_by_another`: as root a real
    chown, otherwise our euid seen as another one (the seam: paths reads os.geteuid())."""
    other = 4242 if os.geteuid() != 4242 else 4243
    if os.geteuid() != 0:
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
        other = me
    yield other


def made_by_another(path: Path, uid: int, perms: int = 0o777) -> Path:
    path.mkdir(parents=True)
    os.chmod(path, perms)
    if os.geteuid() == 0:
        os.chown(path, uid, -1)
    return path


def rgt(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RGT_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "controller.cli.main", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("perms", [0o777, 0o770, 0o755])
def test_our_too_open_home_is_tightened_with_one_warning(
        home: Path, perms: int, caplog: pytest.LogCaptureFixture) -> None:
    home.mkdir()
    os.chmod(home, perms)
    with caplog.at_level(logging.WARNING, logger="controller.paths"):
        Store.open().close()
        assert mode(home) == 0o700
        Store.open().close()
    said = [r.getMessage() for r in caplog.records if r.name == "controller.paths"]
    assert len(said) == 1 and str(home) in said[0] and f"mode {perms:o}" in said[0]
    assert "tightened it to 700" in said[0]


def test_rgt_says_so_once_on_stderr(tmp_path: Path) -> None:
    home = tmp_path / "open"
    home.mkdir()
    os.chmod(home, 0o777)
    first = rgt("status", home=home)
    assert first.returncode == 0, first.stderr
    assert f"warning: {home} was open to other users (mode 777); tightened it to 700" in first.stderr
    assert mode(home) == 0o700
    second = rgt("status", home=home)
    assert second.returncode == 0 and "tightened" not in second.stderr


def test_a_home_owned_by_another_user_is_refused_untouched(home: Path, not_ours: int) -> None:
    made_by_another(home, not_ours)
    with pytest.raises(paths.UnsafeDir) as info:
        Store.open()
    assert isinstance(info.value, StoreError)   # the CLI shows it as error:/hint:, exit 1
    assert f"{home} belongs to uid {not_ours}, not to you" in str(info.value)
    assert "RGT_HOME" in (info.value.hint or "")
    assert mode(home) == 0o777 and not (home / "rgt.db").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the command runs in a child: needs a real chown (root)")
def test_rgt_refuses_a_home_owned_by_another_user(tmp_path: Path) -> None:
    home = made_by_another(tmp_path / "theirs", 4242)
    done = rgt("status", home=home)
    assert done.returncode == 1
    assert f"error: {home} belongs to uid 4242, not to you (uid 0)" in done.stderr
    assert "hint: set RGT_HOME to a directory of your own" in done.stderr
    assert mode(home) == 0o777 and not (home / "rgt.db").exists()


def test_a_shared_sticky_directory_is_refused_not_chmod_ed(home: Path) -> None:
    home.mkdir()
    os.chmod(home, 0o1777)   # what /tmp looks like: chmod 700 on it would break every other user
    with pytest.raises(paths.UnsafeDir) as info:
        Store.open()
    assert "shared directory" in str(info.value)
    assert mode(home) == 0o1777


def test_a_home_that_is_a_file_is_refused(home: Path) -> None:
    home.write_text("not a directory")
    with pytest.raises(paths.UnsafeDir) as info:
        Store.open()
    assert f"{home} is not a directory" in str(info.value)


def test_a_new_home_is_created_0700_even_under_a_loose_umask(home: Path) -> None:
    old = os.umask(0o000)
    try:
        Store.open().close()
    finally:
        os.umask(old)
    assert mode(home) == 0o700 and mode(home / "rgt.db") == 0o600


def test_an_open_socket_directory_of_ours_is_tightened(tmp_path: Path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    os.chmod(ctl, 0o777)
    ssh._private_dir(ctl)   # what start_master and forward do before a socket goes there
    assert mode(ctl) == 0o700


def test_a_socket_directory_that_is_not_ours_is_refused(tmp_path: Path, not_ours: int) -> None:
    theirs = made_by_another(tmp_path / "ctl", not_ours)
    with pytest.raises(ssh.SshError) as info:
        ssh.Ssh("nohost", control_dir=theirs).start_master()
    said = str(info.value)
    assert f"belongs to uid {not_ours}" in said and "refusing to put sockets there" in said


def test_a_planted_symlink_is_refused_where_links_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "rgt-0"   # as in /tmp, where anyone could have made it first
    link.symlink_to(target)
    with pytest.raises(paths.UnsafeDir) as info:
        paths.private_dir(link, follow=False)
    assert "symbolic link" in str(info.value) and mode(target) == 0o755
    assert paths.private_dir(link) == link and mode(target) == 0o700   # RGT_HOME may be a link
