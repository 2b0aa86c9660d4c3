"""What `rgt compare` reads: a run's facts, its metrics, and the config texts inside its fingerprint.

A run is named by a directory on this machine (a run directory of host `local`, or a copy `rgt pull`
made) or by a run name in the store. A stored run on host `local` is read from its run_dir; on any
other host run.json, rgt/fingerprint.json and rgt/preflight.json come through the host's shell in
one read-only command, and metrics.jsonl (its last METRICS_CAP_BYTES) only when it is needed.

Config texts are parsed into flat `dotted.key -> value` maps: JSON and INI/CFG with the standard
library, TOML with tomllib (tomli before 3.11), YAML with PyYAML when it is importable, else with
`read_flat_yaml`, a small reader documented below. A text none of them reads is compared by hash only.
"""
from __future__ import annotations

import configparser
import dataclasses
import json
import logging
import math
import secrets
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from protocol import metrics as schema

from controller import paths
from controller.box.handle import Box
from controller.box.ssh import LocalShell, Ssh, SshError
from controller.store.db import Store

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.9 run
    import tomli as tomllib

log = logging.getLogger(__name__)

METRICS_CAP_BYTES = 64 << 20
JSON_CAP_BYTES = 8 << 20
FETCH_TIMEOUT_S = 120.0
MAX_SIBLINGS = 24
_MISSING = 3   # exit code of the fetch command for a file that is not there

Shell = Union[Ssh, LocalShell]


class CompareError(Exception):
    """A run cannot be read; `hint` says what a person can do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class Metrics:
    """metrics.jsonl as `metric -> step -> value` (a step logged twice keeps its last value)."""

    rows: Dict[str, Dict[int, float]]
    lines: int = 0
    skipped: int = 0          # lines that were torn, not JSON objects, or had no integer step
    truncated: bool = False   # only the file's tail was read
    missing: bool = False


@dataclasses.dataclass
class RunFacts:
    label: str                                   # what the person named
    where: str                                   # a directory here, or HOST:DIR
    run: Dict[str, Any]                          # run.json
    fingerprint: Optional[Dict[str, Any]]
    preflight: Optional[Dict[str, Any]]
    read_metrics: Callable[[], Metrics]
    # Other runs that may share its seed group; each is yielded once, its `where` added to the set.
    siblings: Callable[[Set[str]], Iterator[RunFacts]] = lambda seen: iter(())
    _metrics: Optional[Metrics] = None

    @property
    def run_id(self) -> str:
        return str(self.run.get("id") or Path(self.where).name)

    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._metrics = self.read_metrics()
        return self._metrics


# ---- metrics ------------------------------------------------------------------------------------


def _step(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value)


def parse_metrics(data: Optional[bytes], truncated: bool = False) -> Metrics:
    """Every line that is a JSON object with an integer `step`; anything else is counted, not fatal.
    Only metrics are kept (`protocol.metrics`: no `time`, `timestamp`, `epoch_time` or counter)."""
    if data is None:
        return Metrics({}, missing=True)
    lines = data.split(b"\n")
    if truncated and lines:
        lines = lines[1:]   # the first line of a tail is cut
    out = Metrics({}, truncated=truncated)
    for raw in lines:
        if not raw.strip():
            continue
        out.lines += 1
        try:
            doc = json.loads(raw)
        except ValueError:
            out.skipped += 1
            continue
        step = _step(doc.get("step")) if isinstance(doc, dict) else None
        if step is None:
            out.skipped += 1
            continue
        for key, value in schema.scalars(doc, finite=False).items():   # never step, epoch or a time field
            out.rows.setdefault(key, {})[step] = value
    return out


# ---- a run directory here -----------------------------------------------------------------------


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        doc = json.loads(path.read_bytes()[:JSON_CAP_BYTES])
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _tail(path: Path, cap: int = METRICS_CAP_BYTES) -> Tuple[Optional[bytes], bool]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - cap))
            return f.read(), size > cap
    except OSError:
        return None, False


def _local_metrics(run_dir: Path, run: Dict[str, Any]) -> Callable[[], Metrics]:
    def read() -> Metrics:
        path = run_dir / "metrics.jsonl"
        if not path.is_file() and isinstance(run.get("metrics"), str):
            path = Path(run["metrics"])
        data, truncated = _tail(path)
        return parse_metrics(data, truncated)
    return read


def load_dir(run_dir: Path, label: Optional[str] = None, with_siblings: bool = True) -> RunFacts:
    """A run directory on this machine (the launcher's, or a pulled copy)."""
    run_dir = Path(run_dir)
    run = _read_json(run_dir / "run.json")
    if run is None:
        raise CompareError(f"{run_dir}: no readable run.json",
                           hint="name a run directory (or a copy `rgt pull` made), or a run rgt knows")
    facts = RunFacts(label=label or str(run_dir), where=str(run_dir.resolve()), run=run,
                     fingerprint=_read_json(run_dir / "rgt" / "fingerprint.json"),
                     preflight=_read_json(run_dir / "rgt" / "preflight.json"),
                     read_metrics=_local_metrics(run_dir, run))
    if with_siblings:
        facts.siblings = lambda seen: _dir_siblings(run_dir, seen)
    return facts


def _dir_siblings(run_dir: Path, seen: Set[str]) -> Iterator[RunFacts]:
    try:
        children = sorted(p.resolve() for p in run_dir.resolve().parent.iterdir() if p.is_dir())
    except OSError:
        return
    found = 0
    for child in children:
        if found >= MAX_SIBLINGS:
            return
        if str(child) in seen or not (child / "run.json").is_file():
            continue
        seen.add(str(child))
        try:
            yield load_dir(child, with_siblings=False)
            found += 1
        except CompareError:
            continue


# ---- a run on a box, through its shell ----------------------------------------------------------


def _fetch_many(shell: Shell, paths: Sequence[str], cap: int) -> List[Optional[bytes]]:
    """Each file's bytes (its first `cap`), or None when it is not there; one command, read-only."""
    mark = f"rgt-{secrets.token_hex(8)}"
    parts = [f"B={mark}"]
    for i, path in enumerate(paths):
        q = shlex.quote(path)
        parts.append(f"if [ -f {q} ]; then printf '\\n%s {i} ok\\n' \"$B\"; head -c {cap} -- {q}; "
                     f"else printf '\\n%s {i} missing\\n' \"$B\"; fi")
    try:
        done = shell.run("; ".join(parts), check=False, timeout_s=FETCH_TIMEOUT_S)
    except SshError as e:
        raise CompareError(e.message, e.hint) from e
    if done.returncode != 0:
        raise CompareError(f"{shell.alias}: reading the run's files failed (exit {done.returncode}): "
                           f"{done.stderr.decode('utf-8', 'replace').strip()[-300:]}")
    out: List[Optional[bytes]] = [None] * len(paths)
    for chunk in done.stdout.split(f"\n{mark} ".encode())[1:]:
        head, _, body = chunk.partition(b"\n")
        index, _, state = head.decode("ascii", "replace").partition(" ")
        if index.isdigit() and int(index) < len(paths) and state == "ok":
            out[int(index)] = body
    return out


def _remote_metrics(shell: Shell, run_dir: str, run: Dict[str, Any]) -> Callable[[], Metrics]:
    def read() -> Metrics:
        first = f"{run_dir.rstrip('/')}/metrics.jsonl"
        other = run.get("metrics") if isinstance(run.get("metrics"), str) else first
        command = (f"for f in {shlex.quote(first)} {shlex.quote(str(other))}; do "
                   f"if [ -f \"$f\" ]; then tail -c {METRICS_CAP_BYTES} -- \"$f\"; exit 0; fi; done; "
                   f"exit {_MISSING}")
        try:
            done = shell.run(command, check=False, timeout_s=FETCH_TIMEOUT_S)
        except SshError as e:
            log.warning("metrics of %s: %s", run_dir, e)
            return Metrics({}, missing=True)
        if done.returncode != 0:
            return Metrics({}, missing=True)
        return parse_metrics(done.stdout, len(done.stdout) >= METRICS_CAP_BYTES)
    return read


def load_remote(shell: Shell, host: str, run_dir: str, label: Optional[str] = None) -> RunFacts:
    """A run directory on a box, read through `shell` (nothing there is written)."""
    base = run_dir.rstrip("/")
    raw = _fetch_many(shell, [f"{base}/run.json", f"{base}/rgt/fingerprint.json",
                              f"{base}/rgt/preflight.json"], JSON_CAP_BYTES)
    docs: List[Optional[Dict[str, Any]]] = []
    for data in raw:
        try:
            doc = json.loads(data) if data is not None else None
        except ValueError:
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    if docs[0] is None:
        raise CompareError(f"{host}:{run_dir}: no readable run.json",
                           hint="the run directory may have been moved or deleted on the box")
    return RunFacts(label=label or f"{host}:{run_dir}", where=f"{host}:{run_dir}", run=docs[0],
                    fingerprint=docs[1], preflight=docs[2],
                    read_metrics=_remote_metrics(shell, run_dir, docs[0]))


# ---- a run the store knows ----------------------------------------------------------------------


def _stored(store: Store, info: Dict[str, Any], label: Optional[str],
            shells: Dict[str, Shell]) -> RunFacts:
    run_id, host, run_dir = str(info["run"]), str(info["target"] or ""), str(info["run_dir"] or "")
    if not host or not run_dir:
        raise CompareError(f"run {run_id} was not launched through rgt: no host or run directory known",
                           hint="name its run directory (or a pulled copy) instead")
    if host == paths.LOCAL:
        return load_dir(Path(run_dir), label or run_id, with_siblings=False)
    if host not in shells:
        shells[host] = Box.of(store, host).shell
    return load_remote(shells[host], host, run_dir, label or run_id)


def load_stored(store: Store, name: str, shells: Optional[Dict[str, Shell]] = None) -> RunFacts:
    """A run the store knows by name (or unique prefix); its siblings are the store's other runs."""
    shells = {} if shells is None else shells
    info = store.run(name)
    facts = _stored(store, info, name, shells)
    facts.siblings = lambda seen: _store_siblings(store, str(info["run"]), shells, seen)
    return facts


def _where(info: Dict[str, Any]) -> str:
    host, run_dir = str(info["target"]), str(info["run_dir"])
    return str(Path(run_dir).resolve()) if host == paths.LOCAL else f"{host}:{run_dir}"


def _store_siblings(store: Store, run_id: str, shells: Dict[str, Shell],
                    seen: Set[str]) -> Iterator[RunFacts]:
    found = 0
    for info in store.runs():
        if found >= MAX_SIBLINGS:
            return
        if info["run"] == run_id or not info["target"] or not info["run_dir"] or _where(info) in seen:
            continue
        seen.add(_where(info))
        try:
            yield _stored(store, info, None, shells)
            found += 1
        except (CompareError, SshError) as e:
            log.debug("sibling %s left out: %s", info["run"], e)


# ---- config texts -------------------------------------------------------------------------------


def _scalar(text: str) -> Any:
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def _uncomment(line: str) -> str:
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def read_flat_yaml(text: str) -> Dict[str, Any]:
    """Enough YAML for hand-written configs, when PyYAML is not installed. Not a YAML parser:

    - `key: value` lines; nesting by indentation makes dotted keys (`optim:` then `  lr: 0.1`
      gives `optim.lr`);
    - `- item` lines under a `key:` make a list of the items (each read as a scalar);
    - scalars: integers and floats become numbers, true/false booleans, null/~ None, quotes are
      taken off, anything else (flow mappings, anchors, block strings) stays text;
    - ` #` comments, blank lines and `---` / `...` are skipped.
    """
    out: Dict[str, Any] = {}
    stack: List[Tuple[int, str]] = []        # (indent, dotted key) of the open mappings
    open_key: Optional[Tuple[int, str]] = None
    for raw in text.splitlines():
        line = _uncomment(raw).rstrip()
        body = line.strip()
        if not body or body in ("---", "..."):
            continue
        indent = len(line) - len(line.lstrip())
        if body == "-" or body.startswith("- "):
            if open_key is not None and indent >= open_key[0]:
                items = out.setdefault(open_key[1], [])
                if isinstance(items, list):
                    items.append(_scalar(body[1:]))
            continue
        while stack and indent <= stack[-1][0]:
            stack.pop()
        key, colon, value = body.partition(":")
        if not colon:
            continue
        key = str(_scalar(key)) if key.strip() else key
        dotted = f"{stack[-1][1]}.{key}" if stack else key
        if value.strip():
            out[dotted] = _scalar(value)
            open_key = None
        else:
            stack.append((indent, dotted))
            open_key = (indent, dotted)
    return out


def flatten(doc: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and other values are leaves."""
    if not isinstance(doc, dict) or (not doc and prefix):
        return {prefix: doc}
    out: Dict[str, Any] = {}
    for key, value in doc.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _parse_toml(text: str) -> Any:
    return tomllib.loads(text)


def _parse_yaml(text: str) -> Any:
    try:
        import yaml
    except ImportError:
        return read_flat_yaml(text)
    return yaml.safe_load(text)


def _parse_ini(text: str) -> Any:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    return {name: dict(parser.items(name)) for name in parser.sections()}


_PARSERS: Dict[str, Callable[[str], Any]] = {
    "json": json.loads, "toml": _parse_toml, "yaml": _parse_yaml, "yml": _parse_yaml,
    "ini": _parse_ini, "cfg": _parse_ini,
}


def config_keys(entry: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A fingerprint config entry's text as `dotted.key -> value`, or None when it cannot be read."""
    text, parse = entry.get("text"), _PARSERS.get(str(entry.get("format", "")))
    if not isinstance(text, str) or parse is None:
        return None
    try:
        return flatten(parse(text))
    except Exception as e:  # any parser's error: the file is compared by hash only
        log.debug("config %s not parsed: %r", entry.get("path"), e)
        return None
