"""`rgt install`: the wheel build and its cache, the box's requirements, and installs onto a real
sshd "box" and onto host `local`, all without an index.

The box runs this machine's base Python and gets its dependency wheels from .wheelhouse/ (made
for this Python by `make`). Its pip configuration forbids any index, so an install that needed
one would fail.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import click
import pytest
from click.testing import CliRunner, Result

from controller.box import probe as boxprobe
from controller.box.handle import Box, BoxError, OnboxNotFound, VersionMismatch, check_version
from controller.box.ssh import LocalShell
from controller.cli.base import RgtGroup
from controller.cli.box import install_command, secret_group
from controller.install import build
from controller.install.onbox import InstallError, InstallOptions, _pip_install
from controller.install.wheels import (
    Requirement,
    Wheel,
    WheelError,
    best,
    marker_holds,
    parse_version,
    requirements,
    resolve,
    scan,
)
from controller.store.db import HostNotFound, Store
from protocol import PACKAGE_VERSION
from tests.helpers import REPO
from tests.sshbox import SshBox, sshbox  # noqa: F401  (the fixture)

WHEELHOUSE = REPO / ".wheelhouse"
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
BOX_DEPS = {"pyzmq", "psutil", "nvidia-ml-py", "watchdog", "click", "packaging", "py-spy"}  # py-spy: optional


@click.group(cls=RgtGroup)
def rgt() -> None:
    """The two commands under a root group, as controller/cli/main.py adds them."""


rgt.add_command(install_command)
rgt.add_command(secret_group)


def invoke(args: Sequence[str], env: Dict[str, str]) -> Result:
    return CliRunner().invoke(rgt, list(args), env=env, catch_exceptions=False)


def markers(python_version: str = "3.11", full: str = "3.11.7") -> Dict[str, str]:
    return {"implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
            "platform_machine": "x86_64", "platform_release": "6.1.0", "platform_system": "Linux",
            "platform_version": "#1 SMP", "python_full_version": full,
            "platform_python_implementation": "CPython", "python_version": python_version,
            "sys_platform": "linux"}


# ---- the wheel of this package ----------------------------------------------------------------


def fake_project(root: Path) -> Path:
    """A tiny project named like ours, at our version, to build fast and change freely."""
    (root / "protocol").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "remote-gpu-trainer"\nversion = "{PACKAGE_VERSION}"\n'
        'dependencies = ["click>=8.1", "tomli>=2; python_version < \'3.11\'"]\n'
        '[tool.setuptools.packages.find]\ninclude = ["protocol*"]\n')
    (root / "protocol" / "__init__.py").write_text("X = 1\n")
    return root


def tree(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_the_wheel_is_built_once_per_source_state(tmp_path: Path) -> None:
    src = fake_project(tmp_path / "src")
    cache = tmp_path / "cache"
    before = tree(src)
    first = build.package_wheel(cache, src)
    assert not first.cached and first.path.is_file() and first.version == PACKAGE_VERSION
    assert first.path.parent.name == f"{PACKAGE_VERSION}-{first.source_hash[:16]}"
    assert tree(src) == before  # built from a copy: no build/, no egg-info in the source tree
    stamp = first.path.stat().st_mtime_ns
    (src / "protocol" / "__pycache__").mkdir()
    (src / "protocol" / "__pycache__" / "x.pyc").write_bytes(b"junk")  # not a source file
    again = build.package_wheel(cache, src)
    assert again.cached and again.path == first.path and again.path.stat().st_mtime_ns == stamp
    (src / "protocol" / "__init__.py").write_text("X = 2\n")
    changed = build.package_wheel(cache, src)
    assert not changed.cached and changed.source_hash != first.source_hash
    with zipfile.ZipFile(changed.path) as z:
        assert z.read("protocol/__init__.py") == b"X = 2\n"
    name, version, requires, _ = Wheel.from_path(changed.path).metadata()
    assert (name, version) == ("remote-gpu-trainer", PACKAGE_VERSION) and "click>=8.1" in requires


def test_without_a_source_tree_the_error_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(build.BuildError) as e:
        build.source_root(tmp_path)
    assert "not a remote-gpu-trainer source tree" in e.value.message
    assert e.value.hint and "--wheel FILE" in e.value.hint and "clone" in e.value.hint


def test_a_given_wheel_must_be_this_version(tmp_path: Path) -> None:
    wrong = make_wheel(tmp_path, "remote-gpu-trainer", "0.0.1")
    with pytest.raises(build.BuildError, match="version 0.0.1, but this rgt is"):
        build.given_wheel(wrong)
    other = make_wheel(tmp_path, "something-else", PACKAGE_VERSION)
    with pytest.raises(build.BuildError, match="not remote-gpu-trainer"):
        build.given_wheel(other)


# ---- requirements, markers, versions ----------------------------------------------------------


def make_wheel(where: Path, name: str, version: str, requires: Sequence[str] = (),
               tag: str = "py3-none-any", requires_python: Optional[str] = None) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = where / f"{dist}-{tag}.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Python: {requires_python}"] if requires_python else []
    meta += [f"Requires-Dist: {r}" for r in requires]
    where.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
    return path


def test_requires_dist_markers_are_judged_for_the_box_python(tmp_path: Path) -> None:
    ours = Wheel.from_path(make_wheel(tmp_path, "remote-gpu-trainer", PACKAGE_VERSION, [
        "pyzmq<28,>=23", "click>=8.1", 'tomli>=2; python_version < "3.11"',
        'safetensors>=0.4; extra == "safetensors"', "colorama; platform_system == 'Windows'",
        'exceptiongroup; python_version < "3.11" and (sys_platform == "linux" or os_name == "nt")']))
    on_39 = [r.name for r in requirements(ours, markers("3.9", "3.9.18"))]
    on_311 = [r.name for r in requirements(ours, markers())]
    assert on_39 == ["pyzmq", "click", "tomli", "exceptiongroup"]
    assert on_311 == ["pyzmq", "click"]
    with_extra = [r.name for r in requirements(ours, markers(), extras=["safetensors"])]
    assert "safetensors" in with_extra


MARKERS = [  # (marker, holds on the 3.9 box, holds on the 3.11 box), with the extra "dev-tools"
    ('python_version < "3.11"', True, False),
    ("python_version >= '3.9' and python_version < '3.10'", True, False),
    ('platform_system == "Windows" or (sys_platform == "linux" and platform_machine == "x86_64")',
     True, True),
    ('"linux" in sys_platform', True, True), ("os_name not in 'nt java'", True, True),
    ('python_full_version >= "3.9.2"', True, True), ('python_full_version < "3.11.7"', True, False),
    ('implementation_name == "pypy"', False, False), ('extra == "Dev_Tools"', True, True),
    ('extra == "other"', False, False),
]


@pytest.mark.parametrize("marker, on_39, on_311", MARKERS)
def test_markers_are_judged_in_the_box_environment(marker: str, on_39: bool, on_311: bool) -> None:
    assert marker_holds(marker, markers("3.9", "3.9.18"), ["dev-tools"]) is on_39
    assert marker_holds(marker, markers(), ["dev-tools"]) is on_311


def test_a_marker_the_box_cannot_judge_is_a_wheel_error() -> None:
    with pytest.raises(WheelError, match="cannot read the marker"):
        marker_holds('python_version <<< "3"', markers())
    lacking = {k: v for k, v in markers().items() if k != "platform_release"}
    with pytest.raises(WheelError, match="lacks platform_release"):  # never filled in from this machine
        marker_holds('python_version < "3.11"', lacking)


def test_requirement_parsing() -> None:
    r = Requirement.parse("Foo_Bar[Extra1, extra2] (>=1.0,<2) ; python_version < '3.11'")
    assert (r.name, r.extras) == ("foo-bar", ("extra1", "extra2"))
    assert {str(s) for s in r.specifier} == {">=1.0", "<2"} and str(r.marker) == 'python_version < "3.11"'
    assert str(Requirement.parse("click>=8.1")) == "click>=8.1"
    assert str(Requirement.parse('PyYAML[a]; extra == "x"')) == "pyyaml[a]"  # no marker: pip is asked for it
    with pytest.raises(WheelError, match="names a URL"):
        Requirement.parse("foo @ https://example.com/foo-1.0-py3-none-any.whl")
    with pytest.raises(WheelError, match="not a requirement"):
        Requirement.parse("foo >=> 1")


def test_pre_releases_only_when_named_or_nothing_else_fits(tmp_path: Path) -> None:
    house = tmp_path / "house"
    for version in ("1.9", "2.0rc1"):
        make_wheel(house, "click", version)
    make_wheel(house, "tomli", "3.0b1")
    found = scan([house])

    def pick(spec: str, name: str = "click") -> Optional[Wheel]:
        return best(found[name], Requirement.parse(name + spec), ["py3-none-any"])

    assert str(pick(">=1").version) == "1.9"
    assert str(pick(">=2.0rc1").version) == "2.0rc1"  # the specifier names a pre-release
    assert str(pick(">1.9").version) == "2.0rc1"  # nothing else fits
    assert str(pick("", "tomli").version) == "3.0b1"
    assert pick(">=3") is None


def test_the_newest_wheel_with_a_tag_the_box_accepts_and_the_box_preferred_tag(tmp_path: Path) -> None:
    house = tmp_path / "house"
    make_wheel(house, "pyzmq", "26.0.0", tag="py2.py3-none-any")  # a compressed tag set
    generic = make_wheel(house, "pyzmq", "27.0.0", tag="py3-none-any")
    native = make_wheel(house, "pyzmq", "27.0.0", tag="cp311-cp311-manylinux_2_28_x86_64")
    make_wheel(house, "pyzmq", "28.0.0", tag="cp312-cp312-manylinux_2_28_x86_64")
    found = scan([house])["pyzmq"]
    req = Requirement.parse("pyzmq")
    assert best(found, req, ["cp311-cp311-manylinux_2_28_x86_64", "py3-none-any"]).path == native
    assert best(found, req, ["py3-none-any", "cp311-cp311-manylinux_2_28_x86_64"]).path == generic
    assert str(best(found, req, ["py2-none-any"]).version) == "26.0.0"
    assert best(found, req, ["cp310-cp310-linux_x86_64"]) is None


def test_requires_python_is_judged_for_the_box_python(tmp_path: Path) -> None:
    house = tmp_path / "house"
    make_wheel(house, "numpy", "1.26.0", requires_python=">=3.9")
    make_wheel(house, "numpy", "2.1.0", requires_python=">=3.10")
    found = scan([house])["numpy"]
    req = Requirement.parse("numpy")
    assert str(best(found, req, ["py3-none-any"], parse_version("3.9.18")).version) == "1.26.0"
    assert str(best(found, req, ["py3-none-any"], parse_version("3.11.7")).version) == "2.1.0"


def test_malformed_metadata_is_a_wheel_error_naming_the_wheel(tmp_path: Path) -> None:
    bad = Wheel.from_path(make_wheel(tmp_path, "broken", "1.0", ["click >=> 8"]))
    with pytest.raises(WheelError, match=r"broken-1\.0-py3-none-any\.whl: bad Requires-Dist 'click >=> 8'"):
        requirements(bad, markers())
    odd = Wheel.from_path(make_wheel(tmp_path / "b", "odd", "1.0", ['click; python_version ~= "x"']))
    with pytest.raises(WheelError, match=r"odd-1\.0-py3-none-any\.whl: .*cannot judge the marker"):
        requirements(odd, markers())
    picky = scan([make_wheel(tmp_path / "c", "picky", "1.0", requires_python=">=three").parent])["picky"]
    with pytest.raises(WheelError, match=r"picky-1\.0-py3-none-any\.whl: bad Requires-Python"):
        best(picky, Requirement.parse("picky"), ["py3-none-any"], parse_version("3.11.7"))
    with pytest.raises(WheelError, match="is not a wheel file name"):
        Wheel.from_path(tmp_path / "not-a-wheel.whl")
    (tmp_path / "c" / "junk.whl").write_bytes(b"")
    assert set(scan([tmp_path / "c"])) == {"picky"}  # an unreadable name is skipped


def test_resolution_picks_the_newest_fitting_wheel_and_names_what_is_missing(tmp_path: Path) -> None:
    house = tmp_path / "house"
    ours = make_wheel(tmp_path, "remote-gpu-trainer", PACKAGE_VERSION,
                      ["pyzmq<28,>=23", "watchdog[extra]>=2.1", "click>=8.1", "missing-thing>=1",
                       'tomli>=2; python_version < "3.11"'])
    make_wheel(house, "pyzmq", "27.1.0", tag="cp311-cp311-manylinux_2_28_x86_64")
    make_wheel(house, "pyzmq", "27.3.0", tag="cp312-cp312-manylinux_2_28_x86_64")  # not this Python
    make_wheel(house, "pyzmq", "28.0.0", tag="cp311-cp311-manylinux_2_28_x86_64")  # too new
    make_wheel(house, "watchdog", "6.0.0", ["pyyaml; extra == 'extra'"], tag="py3-none-manylinux2014_x86_64")
    make_wheel(house, "click", "8.1.0")
    make_wheel(house, "click", "9.0.0rc1")  # a pre-release is never picked over a final
    make_wheel(house, "tomli", "2.0.0")
    tags = boxprobe.computed_tags((3, 11, 7), markers(), ["glibc", "2.36"])
    res = resolve(ours, [house], markers(), tags)
    picked = {w.name: str(w.version) for w in res.wheels}
    assert picked == {"remote-gpu-trainer": PACKAGE_VERSION, "pyzmq": "27.1.0", "watchdog": "6.0.0",
                      "click": "8.1.0"}
    assert sorted((str(req), by) for req, by in res.missing) == [
        ("missing-thing>=1", "remote-gpu-trainer"), ("pyyaml", "watchdog")]
    on_39 = resolve(ours, [house], markers("3.9", "3.9.18"),
                    boxprobe.computed_tags((3, 9, 18), markers("3.9"), ["glibc", "2.36"]))
    assert "tomli" in {w.name for w in on_39.wheels} and "pyzmq" in {str(r.name) for r, _ in on_39.missing}


def test_computed_tags_and_an_old_python_answer() -> None:
    tags = boxprobe.computed_tags((3, 11, 2), markers(), ["glibc", "2.31"])
    assert tags[0] == "cp311-cp311-manylinux_2_31_x86_64"
    assert {"cp311-abi3-manylinux2014_x86_64", "cp36-abi3-linux_x86_64", "py3-none-any"} <= set(tags)
    assert "cp311-cp311-manylinux_2_32_x86_64" not in tags
    with pytest.raises(boxprobe.ProbeError, match="Python 3.5.2; rgt-onbox needs Python 3.9"):
        boxprobe.parse(b'{"version": [3, 5, 2], "venv": "/v", "wheels_dir": "/w"}\n', "python3")
    with pytest.raises(boxprobe.ProbeError, match="did not answer"):
        boxprobe.parse(b"  File \"<string>\", line 1\nSyntaxError\n", "python")


# ---- the box's pip and its index --------------------------------------------------------------


class ScriptedShell:
    """Answers run() from a script of (returncode, stderr); records every command line."""

    alias = "fake"

    def __init__(self, answers: List[tuple]) -> None:
        self.answers = list(answers)
        self.commands: List[str] = []

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        self.commands.append(command)
        code, err = self.answers.pop(0)
        return subprocess.CompletedProcess(command, code, b"", err)

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None:
        raise AssertionError("not used")


MISSING = b"ERROR: Could not find a version that satisfies the requirement click>=8.1\n" \
          b"ERROR: No matching distribution found for click>=8.1\n"


def box_python() -> boxprobe.BoxPython:
    return boxprobe.BoxPython(version=(3, 11, 7), executable="/py", home="/h", venv="/h/.rgt/venv",
                              wheels_dir="/h/.rgt/wheels", markers=markers(), tags=["py3-none-any"],
                              tags_from="pip", venv_python=True, record=None, wheels={})


def test_the_box_index_is_asked_only_with_index_and_says_so(tmp_path: Path) -> None:
    ours = Wheel.from_path(make_wheel(tmp_path, "remote-gpu-trainer", PACKAGE_VERSION))
    lines: List[str] = []
    shell = ScriptedShell([(1, MISSING), (0, b"")])
    assert _pip_install(shell, box_python(), ours, InstallOptions(index=True), lines.append, force=False)
    assert "--no-index" in shell.commands[0] and "--no-index" not in shell.commands[1]
    assert any("no wheel for click>=8.1; --index: retrying once with the box's own index" in line
               for line in lines)

    strict = ScriptedShell([(1, MISSING)])  # the default: no silent fallback
    with pytest.raises(InstallError, match="no wheel for click>=8.1, and its own index is not used without"):
        _pip_install(strict, box_python(), ours, InstallOptions(), lines.append, force=False)
    assert len(strict.commands) == 1

    extra = ScriptedShell([(0, b"")])
    _pip_install(extra, box_python(), ours, InstallOptions(), lines.append, force=False, extra=["py-spy"])
    assert extra.commands[0].endswith(" py-spy") and "--no-index" in extra.commands[0]

    other = ScriptedShell([(1, b"ERROR: disk full\n")])  # not a missing wheel: no second try
    with pytest.raises(InstallError, match="disk full"):
        _pip_install(other, box_python(), ours, InstallOptions(), lines.append, force=False)
    assert len(other.commands) == 1

    forced = ScriptedShell([(0, b"")])
    _pip_install(forced, box_python(), ours, InstallOptions(), lines.append, force=True)
    assert "--force-reinstall" in forced.commands[0] and ours.path.name in forced.commands[0]


# ---- rgt-onbox on a box -----------------------------------------------------------------------


def test_check_version_and_the_box_handle(tmp_path: Path) -> None:
    shell = LocalShell()
    assert check_version(shell, "echo rgt-onbox, version " + PACKAGE_VERSION + " #") == PACKAGE_VERSION
    with pytest.raises(VersionMismatch) as e:
        check_version(shell, "echo 'rgt-onbox, version 0.0.1' #", host="gpu1")
    assert f"rgt-onbox 0.0.1, but this rgt is {PACKAGE_VERSION}" in e.value.message
    assert e.value.hint == "rgt install gpu1"
    with pytest.raises(OnboxNotFound, match="exit 127"):
        check_version(shell, "/no/such/rgt-onbox", host="gpu1")
    # one base for what a box refuses: a version check's failure and an install's alike
    assert issubclass(OnboxNotFound, VersionMismatch) and issubclass(VersionMismatch, BoxError)
    assert issubclass(InstallError, BoxError) and not issubclass(VersionMismatch, InstallError)
    with Store.open(tmp_path / "rgt.db") as store:
        store.add_host("plain", ssh="plain")
        store.add_host("custom", ssh="custom", onbox="~/env/bin/rgt-onbox", profile="autodl")
        store.add_host("done", ssh="done", onbox="~/env/bin/rgt-onbox")
        store.set_installed("done", {"version": PACKAGE_VERSION, "onbox": "/home/u/.rgt/venv/bin/rgt-onbox"})
        assert Box.of(store, "plain").onbox == "rgt-onbox"
        assert Box.of(store, "custom").onbox == "~/env/bin/rgt-onbox"
        assert Box.of(store, "done").onbox == "/home/u/.rgt/venv/bin/rgt-onbox"
        store.add_host("spaced", ssh="spaced")
        store.set_installed("spaced", {"version": PACKAGE_VERSION, "onbox": "/home/u/my rgt é/bin/rgt-onbox"})
        assert shlex.split(Box.of(store, "spaced").onbox) == ["/home/u/my rgt é/bin/rgt-onbox"]
        assert Box.of(store, "custom").profile == "autodl" and Box.of(store, "plain").profile == ""
        local = Box.of(store, "local")  # this machine, also when not stored
        # shell text, each word quoted: this Python's path may hold a space or a non-ASCII letter
        assert shlex.split(local.onbox) == [sys.executable, "-m", "onbox.cli"]
        assert local.record["name"] == "local"
        assert isinstance(local.shell, LocalShell) and local.shell is local.shell  # made once, kept
        assert local.check_version() == PACKAGE_VERSION
        done, answer = local.run_onbox(["--version"])
        assert done.returncode == 0 and PACKAGE_VERSION in done.stdout.decode() and answer is None
        store.add_host("json", ssh="json", onbox="""printf '%s\\n' noise '{"ok": 1}' #""")
        given = LocalShell()
        box = Box.of(store, "json", shell=given)
        assert box.shell is given and box.run_onbox(["ps", "--json"])[1] == {"ok": 1}
        with pytest.raises(OnboxNotFound, match="rgt-onbox does not run on json"):
            box.check_version()
        with pytest.raises(HostNotFound):
            Box.of(store, "nosuch")


# ---- installs end to end ----------------------------------------------------------------------


def forbid_index(home: Path) -> None:
    """pip on the box may use no index at all (and the one it names does not answer)."""
    assert WHEELHOUSE.is_dir(), "run `make` once: it fetches the box's wheels into .wheelhouse/"
    conf = home / ".config" / "pip"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "pip.conf").write_text("[global]\nno-index = true\nindex-url = http://127.0.0.1:9/simple\n")


@pytest.fixture
def box(sshbox: SshBox, tmp_path: Path) -> Iterator[Dict[str, Any]]:  # noqa: F811
    forbid_index(sshbox.home)
    # PIP_NO_INDEX: the laptop's own `pip download` of a missing wheel finds nothing either
    env = {"RGT_HOME": str(tmp_path / "state"), "RGT_SSH_CONFIG": str(sshbox.config_file),
           "PIP_NO_INDEX": "1"}
    with Store.open(tmp_path / "state" / "rgt.db") as store:
        store.add_host("box", ssh=sshbox.alias)
    yield {"box": sshbox, "env": env, "state": tmp_path / "state"}


def stderr_lines(result: Result, prefix: str) -> List[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(prefix)]


@pytest.mark.e2e
def test_install_onto_the_box_offline_then_again_as_a_no_op(box: Dict[str, Any]) -> None:
    the_box, env = box["box"], box["env"]
    args = ["install", "box", "--wheelhouse", str(WHEELHOUSE), "--python", BASE_PYTHON,
            "--no-index-fallback"]
    first = invoke([*args, "--json"], env)
    assert first.exit_code == 0, first.stderr
    out = json.loads(first.stdout)
    venv = the_box.home / ".rgt" / "venv"
    assert out["venv"] == str(venv) and out["onbox"] == str(venv / "bin" / "rgt-onbox")
    assert out["version"] == PACKAGE_VERSION and out["already"] is False and out["used_index"] is False
    assert out["copied_files"] == 1 + len(BOX_DEPS) and out["recorded"] is True
    assert sorted(out["shipped"]) == sorted(BOX_DEPS | {"remote-gpu-trainer"}) and not out["warnings"]
    copy = f"copy: {1 + len(BOX_DEPS)} files"
    for step in ("build:", "probe:", copy, "venv: creating", "install:", "verify:"):
        assert stderr_lines(first, step), (step, first.stderr)
    shipped = {Wheel.from_path(p).name for p in (the_box.home / ".rgt" / "wheels").glob("*.whl")}
    assert shipped == BOX_DEPS | {"remote-gpu-trainer"}  # exactly what the box needs, nothing else
    version = subprocess.run([str(venv / "bin" / "rgt-onbox"), "--version"], capture_output=True,
                             text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert version.stdout.split()[-1] == PACKAGE_VERSION
    assert (venv / "bin" / "py-spy").is_file()  # shipped and installed: the sidecar's stack dumper
    with Store.open(box["state"] / "rgt.db") as store:
        installed = store.host("box")["installed"]
        assert installed["version"] == PACKAGE_VERSION and installed["onbox"] == out["onbox"]
        assert installed["venv"] == str(venv) and installed["python"] == f"{sys.version_info[0]}." \
            f"{sys.version_info[1]}.{sys.version_info[2]}" and installed["installed_at"] > 0
        assert Box.of(store, "box").onbox == out["onbox"]

    # the same wheel again (the source tree may change under a running suite: pass the built one)
    wheel = next((box["state"] / "wheels").glob("*/*.whl"))
    wheels_dir = the_box.home / ".rgt" / "wheels"
    stamps = {p.name: p.stat().st_mtime_ns for p in wheels_dir.iterdir()}
    again = invoke([*args, "--wheel", str(wheel)], env)
    assert again.exit_code == 0, again.stderr
    assert f"rgt-onbox {PACKAGE_VERSION} is already installed on box" in again.stdout
    assert stderr_lines(again, "verify:") and not stderr_lines(again, "copy:")
    assert not stderr_lines(again, "venv:")
    assert {p.name: p.stat().st_mtime_ns for p in wheels_dir.iterdir()} == stamps


@pytest.mark.e2e
def test_a_missing_wheel_without_index_fallback_names_the_requirement(box: Dict[str, Any],
                                                                      tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(WHEELHOUSE, partial)
    for p in partial.glob("click-*.whl"):
        p.unlink()
    result = invoke(["install", "box", "--wheelhouse", str(partial), "--python", BASE_PYTHON], box["env"])
    assert result.exit_code == 1  # the default: never the box's index without saying so
    assert "error: no wheel for the box's Python" in result.stderr and "click>=8.1" in result.stderr
    assert "needed by remote-gpu-trainer" in result.stderr and "pip download here failed" in result.stderr
    assert "download: click>=8.1" in result.stderr  # it tried to fetch it here first
    assert "hint: pass --wheelhouse" in result.stderr and "--index" in result.stderr
    assert not (box["box"].home / ".rgt" / "venv").exists()  # refused before anything changed there


@pytest.mark.e2e
def test_a_missing_optional_py_spy_is_a_warning_not_a_failure(box: Dict[str, Any], tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(WHEELHOUSE, partial)
    for p in partial.glob("py_spy-*.whl"):
        p.unlink()
    result = invoke(["install", "box", "--wheelhouse", str(partial), "--python", BASE_PYTHON, "--json"],
                    box["env"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert "py-spy" not in out["shipped"] and "click" in out["shipped"]
    assert len(out["warnings"]) == 1 and "no py-spy>=0.3 wheel" in out["warnings"][0]
    assert not (box["box"].home / ".rgt" / "venv" / "bin" / "py-spy").exists()


@pytest.mark.e2e
def test_host_local_installs_through_the_local_shell(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    forbid_index(home)
    env = {"RGT_HOME": str(tmp_path / "state"), "HOME": str(home), "PIP_NO_INDEX": "1"}
    result = invoke(["install", "local", "--wheelhouse", str(WHEELHOUSE), "--python", BASE_PYTHON,
                     "--no-index-fallback", "--venv", "~/venv", "--json"], env)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["venv"] == str(home / "venv") and out["recorded"] is False  # `local` has no stored row
    version = subprocess.run([out["onbox"], "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.split()[-1] == PACKAGE_VERSION
    assert sorted(p.name for p in (home / ".rgt" / "wheels").glob("remote_gpu_trainer-*.whl"))


def test_an_unknown_host_is_refused(tmp_path: Path) -> None:
    result = invoke(["install", "nowhere"], {"RGT_HOME": str(tmp_path)})
    assert result.exit_code == 1 and "error: no host 'nowhere'" in result.stderr
