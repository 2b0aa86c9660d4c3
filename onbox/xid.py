"""What an Xid means on a rented box: the catalog loader, classification and a deduper.

The meaning lives in data (``onbox/data/xids.json``, read through importlib.resources so it works
from an installed wheel); this module only loads, validates and applies it. Each code maps to a
class that says what a tenant should do:

    application     the job's own fault: fix the code or restart from the last checkpoint
    gpu_reset       the GPU needs a reset, which a tenant cannot do: re-rent
    node_reboot     the node needs a reboot: re-rent
    memory          memory/ECC; fatal for uncorrectable errors, a warning for corrected ones
    nvlink          the GPU interconnect
    informational   nothing to do on its own
    unknown         not in the catalog (severity warn)

A recovery action reported by the driver (Xid 154's text, or NVML's recovery-action field) wins
over the table: ``classify(79, "none")`` is not fatal, ``classify(13, "gpu_reset")`` is.

Nothing is read at import time; the catalog loads on first use and is cached.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from protocol import SEVERITIES

from onbox.errors import OnboxError
from onbox.sources.gpu import RECOVERY_ACTIONS

CLASSES: Tuple[str, ...] = (
    "application",
    "gpu_reset",
    "node_reboot",
    "memory",
    "nvlink",
    "informational",
    "unknown",
)
SUPPORTED_SCHEMA_VERSIONS: Tuple[int, ...] = (1,)

# Xid 154 prints the NVML recovery-action numbers ("... to 0x2 (Node Reboot Required)").
RECOVERY_ACTION_BY_NVML: Dict[int, str] = RECOVERY_ACTIONS

# Spellings seen from callers, nvidia-smi and Xid 154 text, after lowercasing and turning spaces and
# dashes into underscores. Canonical names map to themselves.
_RECOVERY_ALIASES: Dict[str, str] = {
    "none": "none",
    "no_action": "none",
    "reset": "gpu_reset",
    "gpu_reset": "gpu_reset",
    "gpu_reset_required": "gpu_reset",
    "reset_required": "gpu_reset",
    "pf_flr": "gpu_reset",
    "reboot": "node_reboot",
    "node_reboot": "node_reboot",
    "node_reboot_required": "node_reboot",
    "reboot_required": "node_reboot",
    "os_reboot": "node_reboot",
    "drain_p2p": "drain_p2p",
    "drain_and_reset": "drain_and_reset",
    "recover_imex_domain": "recover_imex_domain",
    "bus_reset": "bus_reset",
    "system_reboot": "system_reboot",
}

_PCI_RE = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


class XidCatalogError(OnboxError, ValueError):
    """The Xid catalog file is missing, not JSON, or does not follow its schema."""


def normalize_pci(text: Optional[str]) -> Optional[str]:
    """A PCI address as ``dddd:bb:dd`` in lowercase, the function dropped; None if it is not one.

    Accepts what the driver prints in Xid lines (``PCI:0000:3B:00``), NVML bus ids
    (``00000000:3B:00.0``) and short forms (``3b:00.0``, domain 0).
    """
    if text is None:
        return None
    m = _PCI_RE.match(text.strip())
    if m is None:
        return None
    domain = int(m.group("domain") or "0", 16)
    if domain > 0xFFFF:
        return None
    bus, dev = int(m.group("bus"), 16), int(m.group("dev"), 16)
    return f"{domain:04x}:{bus:02x}:{dev:02x}"


def normalize_recovery_action(value: Union[str, int, None]) -> Optional[str]:
    """The canonical recovery-action name for an NVML number or a spelling of one; None if unknown.

    Canonical names: none, gpu_reset, node_reboot, drain_p2p, drain_and_reset, recover_imex_domain,
    bus_reset, system_reboot. ``"reset"`` and ``"reboot"`` are accepted as short forms.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return RECOVERY_ACTION_BY_NVML.get(value)
    key = re.sub(r"[\s\-]+", "_", value.strip().lower())
    for prefix in ("nvml_gpu_recovery_action_", "gpu_recovery_action_"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return _RECOVERY_ALIASES.get(key)


@dataclass(frozen=True)
class XidInfo:
    """What one Xid means. `xid_class` is one of CLASSES; `advice_from` is catalog, driver or default."""

    code: int
    name: str
    description: str
    xid_class: str
    severity: str
    fatal: bool
    advice: str
    source: str
    known: bool
    nvidia_action: Optional[str] = None
    recovery_action: Optional[str] = None
    advice_from: str = "catalog"

    def to_dict(self) -> Dict[str, Any]:
        return {
            "code": self.code,
            "name": self.name,
            "description": self.description,
            "class": self.xid_class,
            "severity": self.severity,
            "fatal": self.fatal,
            "advice": self.advice,
            "source": self.source,
            "known": self.known,
            "nvidia_action": self.nvidia_action,
            "recovery_action": self.recovery_action,
            "advice_from": self.advice_from,
        }


@dataclass(frozen=True)
class _ClassSpec:
    severity: str
    fatal: bool
    advice: str


@dataclass(frozen=True)
class _ActionSpec:
    xid_class: Optional[str]
    fatal: bool
    severity: Optional[str]
    advice: str


def _require(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise XidCatalogError(f"xid catalog: {where}: {what}")


def _str_field(obj: Mapping[str, Any], key: str, where: str, optional: bool = False) -> Optional[str]:
    value = obj.get(key)
    if value is None and optional:
        return None
    _require(isinstance(value, str) and value != "", where, f"{key!r} must be a non-empty string")
    return str(value)


def _severity_field(obj: Mapping[str, Any], where: str) -> Optional[str]:
    value = obj.get("severity")
    _require(value is None or value in SEVERITIES, where, f"severity must be one of {SEVERITIES}")
    return None if value is None else str(value)


def _parse_classes(raw: Any) -> Dict[str, _ClassSpec]:
    _require(isinstance(raw, dict), "classes", "must be an object")
    _require(set(raw) == set(CLASSES), "classes", f"must define exactly {CLASSES}")
    out: Dict[str, _ClassSpec] = {}
    for name, spec in raw.items():
        where = f"classes.{name}"
        _require(isinstance(spec, dict), where, "must be an object")
        severity = _severity_field(spec, where)
        _require(severity is not None, where, "severity is required")
        _require(isinstance(spec.get("fatal"), bool), where, "fatal must be true or false")
        out[name] = _ClassSpec(str(severity), bool(spec["fatal"]), str(_str_field(spec, "advice", where)))
    return out


def _parse_actions(raw: Any) -> Dict[str, _ActionSpec]:
    _require(isinstance(raw, dict), "recovery_actions", "must be an object")
    out: Dict[str, _ActionSpec] = {}
    for name, spec in raw.items():
        where = f"recovery_actions.{name}"
        _require(name in RECOVERY_ACTION_BY_NVML.values(), where, "not a known recovery action")
        _require(isinstance(spec, dict), where, "must be an object")
        cls = spec.get("class")
        _require(cls is None or cls in CLASSES, where, f"class must be null or one of {CLASSES}")
        _require(isinstance(spec.get("fatal"), bool), where, "fatal must be true or false")
        out[name] = _ActionSpec(cls, bool(spec["fatal"]), _severity_field(spec, where),
                                str(_str_field(spec, "advice", where)))
    missing = set(RECOVERY_ACTION_BY_NVML.values()) - set(out)
    _require(not missing, "recovery_actions", f"missing {sorted(missing)}")
    return out


def _parse_entry(code_text: str, spec: Any, classes: Mapping[str, _ClassSpec]) -> XidInfo:
    where = f"xids.{code_text}"
    _require(code_text.isdigit(), where, "key must be a decimal Xid code")
    _require(isinstance(spec, dict), where, "must be an object")
    cls = spec.get("class")
    _require(cls in CLASSES and cls != "unknown", where, f"class must be one of {CLASSES[:-1]}")
    _require(isinstance(spec.get("fatal"), bool), where, "fatal must be true or false")
    fatal = bool(spec["fatal"])
    severity = _severity_field(spec, where)
    if severity is None:
        severity = "critical" if fatal else classes[str(cls)].severity
    return XidInfo(
        code=int(code_text),
        name=str(_str_field(spec, "name", where)),
        description=str(_str_field(spec, "description", where)),
        xid_class=str(cls),
        severity=severity,
        fatal=fatal,
        advice=str(_str_field(spec, "advice", where)),
        source=str(_str_field(spec, "source", where)),
        known=True,
        nvidia_action=_str_field(spec, "nvidia_action", where, optional=True),
    )


class XidCatalog:
    """The validated catalog. Build it with `XidCatalog.from_json` or `load_catalog`."""

    def __init__(
        self,
        schema_version: int,
        verified: str,
        entries: Dict[int, XidInfo],
        classes: Dict[str, _ClassSpec],
        actions: Dict[str, _ActionSpec],
    ) -> None:
        self.schema_version = schema_version
        self.verified = verified
        self.entries = entries
        self._classes = classes
        self._actions = actions

    @classmethod
    def from_json(cls, text: str) -> XidCatalog:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise XidCatalogError(f"xid catalog: not valid JSON: {e}") from e
        _require(isinstance(doc, dict), "top level", "must be an object")
        version = doc.get("schema_version")
        _require(version in SUPPORTED_SCHEMA_VERSIONS, "schema_version",
                 f"{version!r} is not supported (supported: {SUPPORTED_SCHEMA_VERSIONS})")
        verified = doc.get("verified")
        _require(isinstance(verified, str) and re.match(r"^\d{4}-\d{2}", verified) is not None,
                 "verified", "must be a YYYY-MM date")
        classes = _parse_classes(doc.get("classes"))
        actions = _parse_actions(doc.get("recovery_actions"))
        raw_xids = doc.get("xids")
        _require(isinstance(raw_xids, dict) and len(raw_xids) > 0, "xids", "must be a non-empty object")
        entries = {}
        for code_text, spec in raw_xids.items():
            info = _parse_entry(code_text, spec, classes)
            entries[info.code] = info
        return cls(int(version), str(verified), entries, classes, actions)

    def class_severity(self, xid_class: str) -> str:
        return self._classes[xid_class].severity

    def lookup(self, code: int) -> XidInfo:
        """The table's own meaning of `code`; class "unknown" when the code is not in the table."""
        info = self.entries.get(code)
        if info is not None:
            return info
        spec = self._classes["unknown"]
        return XidInfo(
            code=code,
            name=f"Xid {code}",
            description=f"Not in this catalog (verified {self.verified}).",
            xid_class="unknown",
            severity=spec.severity,
            fatal=spec.fatal,
            advice=spec.advice,
            source="default",
            known=False,
            advice_from="default",
        )

    def classify(self, code: int, recovery_action: Union[str, int, None] = None) -> XidInfo:
        """What `code` means; a recovery action the driver reported wins over the table.

        An action this module does not know is ignored (the table decides).
        """
        info = self.lookup(code)
        action = normalize_recovery_action(recovery_action)
        if action is None:
            return info
        spec = self._actions[action]
        xid_class = spec.xid_class or info.xid_class
        if spec.severity is not None:
            severity = spec.severity
        else:  # "none": keep the table's severity, but nothing critical once the driver says so
            severity = "warn" if info.severity == "critical" else info.severity
        return XidInfo(
            code=info.code,
            name=info.name,
            description=info.description,
            xid_class=xid_class,
            severity=severity,
            fatal=spec.fatal,
            advice=spec.advice,
            source=info.source,
            known=info.known,
            nvidia_action=info.nvidia_action,
            recovery_action=action,
            advice_from="driver",
        )


def _read_packaged_catalog() -> str:
    try:
        return importlib.resources.files("onbox.data").joinpath("xids.json").read_text(encoding="utf-8")
    except (OSError, ModuleNotFoundError) as e:
        raise XidCatalogError(f"xid catalog: cannot read onbox/data/xids.json: {e}") from e


@functools.lru_cache(maxsize=1)
def default_catalog() -> XidCatalog:
    """The catalog shipped in the package, loaded once."""
    return XidCatalog.from_json(_read_packaged_catalog())


def load_catalog(text: Optional[str] = None) -> XidCatalog:
    """Parse and validate catalog JSON; without `text`, the packaged catalog (cached)."""
    if text is None:
        return default_catalog()
    return XidCatalog.from_json(text)


def classify(code: int, recovery_action: Union[str, int, None] = None) -> XidInfo:
    """`XidCatalog.classify` on the packaged catalog."""
    return default_catalog().classify(code, recovery_action)


class XidDeduper:
    """Lets one report of an Xid through per (pci, code) per window.

    NVML events and the kernel log both report the same Xid; a storm repeats one for minutes. The
    first report of a key passes; later ones within `window_s` of the last one that passed are
    suppressed and counted, so an ongoing storm still passes once per window. PCI addresses are
    normalized, so ``00000000:3B:00.0`` (NVML) and ``0000:3b:00`` (kernel log) are the same GPU.
    Safe to share between threads.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Dict[Tuple[Optional[str], int], float] = {}
        self._suppressed: Dict[Tuple[Optional[str], int], int] = {}

    @staticmethod
    def _key(pci: Optional[str], code: int) -> Tuple[Optional[str], int]:
        return (normalize_pci(pci) or pci, int(code))

    def admit(self, pci: Optional[str], code: int) -> bool:
        """True if this report should go out; False if it repeats one inside the window."""
        key = self._key(pci, code)
        now = self._clock()
        with self._lock:
            self._prune(now)
            last = self._last.get(key)
            if last is not None and now - last < self.window_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            self._suppressed[key] = 0
            return True

    def suppressed(self, pci: Optional[str], code: int) -> int:
        """How many reports of this key were suppressed since it last passed."""
        with self._lock:
            return self._suppressed.get(self._key(pci, code), 0)

    def _prune(self, now: float) -> None:
        stale = [k for k, t in self._last.items() if now - t >= self.window_s and not self._suppressed.get(k)]
        for k in stale:
            del self._last[k]
            self._suppressed.pop(k, None)
