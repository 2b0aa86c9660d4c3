"""One round trip that tells `rgt install` what a box's Python is and what is already there.

The probe is a small script run with the box's Python (`PY -c PROBE VENV WHEELS`). It is written to
run on any Python that can print JSON (2.7 included), so an old interpreter is named and refused
cleanly instead of failing on syntax. It reports the version, the PEP 508 marker environment, the
wheel tags the interpreter accepts (from the pip it ships with; computed here from its facts when it
has none), the home directory with VENV and WHEELS made absolute, whether VENV/bin/python exists,
the record `rgt install` left in the venv, and the wheels already in WHEELS (size and SHA-256).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any, Dict, List, Mapping, Optional, Tuple

MARKER_FILE = ".rgt-install.json"

PROBE = r'''
import hashlib, json, os, platform, sys
def sha(p):
    d = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            d.update(b)
    return d.hexdigest()
venv = os.path.abspath(os.path.expanduser(sys.argv[1]))
wheels = os.path.abspath(os.path.expanduser(sys.argv[2]))
out = {"version": list(sys.version_info[:3]), "executable": sys.executable, "venv": venv,
       "wheels_dir": wheels, "home": os.path.expanduser("~")}
if sys.version_info >= (3, 6):
    import sysconfig
    i = sys.implementation
    iv = "%d.%d.%d" % tuple(i.version[:3])
    if i.version.releaselevel != "final":
        iv += i.version.releaselevel[0] + str(i.version.serial)
    out["markers"] = {
        "implementation_name": i.name, "implementation_version": iv, "os_name": os.name,
        "platform_machine": platform.machine(), "platform_release": platform.release(),
        "platform_system": platform.system(), "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
    out["libc"] = list(platform.libc_ver())
    out["soabi"] = sysconfig.get_config_var("SOABI")
    try:
        from pip._vendor.packaging import tags
        out["tags"] = [str(t) for t in tags.sys_tags()]
    except Exception:
        out["tags"] = []
    out["venv_python"] = os.path.exists(os.path.join(venv, "bin", "python"))
    try:
        with open(os.path.join(venv, ".rgt-install.json")) as f:
            out["record"] = json.load(f)
    except Exception:
        out["record"] = None
    found = {}
    if os.path.isdir(wheels):
        for n in sorted(os.listdir(wheels)):
            p = os.path.join(wheels, n)
            if n.endswith(".whl") and os.path.isfile(p):
                found[n] = [os.path.getsize(p), sha(p)]
    out["wheels"] = found
print(json.dumps(out))
'''


class ProbeError(Exception):
    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass
class BoxPython:
    """What the probe found (see the module doc)."""

    version: Tuple[int, int, int]
    executable: str
    home: str
    venv: str                        # absolute on the box
    wheels_dir: str                  # absolute on the box
    markers: Dict[str, str]
    tags: List[str]                  # most preferred first
    tags_from: str                   # "pip" or "computed"
    venv_python: bool
    record: Optional[Dict[str, Any]]  # what the last install wrote into the venv
    wheels: Dict[str, Tuple[int, str]]  # file name -> (size, sha256) already on the box

    @property
    def version_text(self) -> str:
        return ".".join(str(p) for p in self.version)


def command(python_word: str, venv: str, wheels_dir: str) -> str:
    """The probe's command line: `python_word` is already shell text (a leading ~/ expands)."""
    return f"{python_word} -c {shlex.quote(PROBE)} {shlex.quote(venv)} {shlex.quote(wheels_dir)}"


def computed_tags(version: Tuple[int, int, int], markers: Mapping[str, str], libc: List[str]) -> List[str]:
    """CPython on glibc Linux, best first: the fallback when the box's Python has no pip."""
    major, minor = version[0], version[1]
    arch = markers.get("platform_machine", "") or "x86_64"
    plats: List[str] = []
    if len(libc) == 2 and libc[0] == "glibc" and libc[1].count(".") >= 1:
        glibc_major, glibc_minor = (int(p) for p in libc[1].split(".")[:2])
        for m in range(glibc_minor, -1, -1):
            plats.append(f"manylinux_{glibc_major}_{m}_{arch}")
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(m)
            if glibc_major == 2 and legacy:
                plats.append(f"{legacy}_{arch}")
    plats.append(f"linux_{arch}")
    cp = f"cp{major}{minor}"
    tags = [f"{cp}-{cp}-{p}" for p in plats] + [f"{cp}-abi3-{p}" for p in plats]
    tags += [f"{cp}-none-{p}" for p in plats]
    tags += [f"cp{major}{m}-abi3-{p}" for m in range(minor - 1, 1, -1) for p in plats]
    tags += [f"py{major}{minor}-none-{p}" for p in plats] + [f"py{major}-none-{p}" for p in plats]
    tags += [f"{cp}-none-any", f"py{major}{minor}-none-any", f"py{major}-none-any"]
    tags += [f"py{major}{m}-none-any" for m in range(minor - 1, -1, -1)]
    return tags


def parse(stdout: bytes, python: str, host: str = "the box") -> BoxPython:
    """The probe's answer; ProbeError when the interpreter is too old to give one in full."""
    text = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        doc = json.loads(text[-1]) if text else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("version"), list):
        raise ProbeError(f"{python} on {host} did not answer the probe (is it Python 3?)",
                         hint="pass --python with the path of a Python 3.9+ on the box")
    version = tuple(int(v) for v in doc["version"][:3])
    if "markers" not in doc:
        raise ProbeError(f"{python} on {host} is Python {'.'.join(map(str, version))}; "
                         "rgt-onbox needs Python 3.9 or newer",
                         hint="pass --python with the path of a Python 3.9+ on the box")
    tags = [str(t) for t in doc.get("tags") or []]
    padded = (*version, 0, 0, 0)
    v3 = (padded[0], padded[1], padded[2])
    markers = {str(k): str(v) for k, v in doc["markers"].items()}
    return BoxPython(
        version=v3, executable=str(doc.get("executable", "")),
        home=str(doc.get("home", "")), venv=str(doc["venv"]), wheels_dir=str(doc["wheels_dir"]),
        markers=markers, tags=tags or computed_tags(v3, markers, list(doc.get("libc") or [])),
        tags_from="pip" if tags else "computed", venv_python=bool(doc.get("venv_python")),
        record=doc.get("record") if isinstance(doc.get("record"), dict) else None,
        wheels={str(k): (int(v[0]), str(v[1])) for k, v in (doc.get("wheels") or {}).items()})


__all__ = ["MARKER_FILE", "PROBE", "BoxPython", "ProbeError", "command", "computed_tags", "parse"]
