"""What each file of a standard checkpoint is, and how far it may be loaded (standard library only).

A file's role comes from its name (and the manifest's kind), never from what it claims inside:

- "weights": model weights. `*.safetensors` (shards included), `pytorch_model*.bin`, a Lightning
  `.ckpt` (its "state_dict"), and any other torch file of a checkpoint that is not a known companion
  (rgt's own `step000100.pt`). They load with weights_only=True and must hold tensors; the NaN/Inf
  check looks at these only (for a `.ckpt` only inside its state_dict: ModelCheckpoint's own state
  holds `kth_value = inf` by design).
- "companion": a trainer's non-tensor state, loaded with weights_only=True plus the explicit
  allow-list of the globals it legitimately needs (ALLOW_LISTS): `rng_state*.pth` needs numpy's
  array types for numpy's RNG state; `optimizer.pt`, `scheduler.pt`, `scaler.pt` need nothing more.
  An empty companion is fine ("holds no tensors" is no failure for it).
- "code_pickle": `training_args.bin`. transformers 5.x pickles the TrainingArguments class itself
  (and accelerate's PartialState, enums of transformers): code, which no safe loader may build. So it
  is proven by identity alone; its pickle is only parsed (pickletools, nothing executed) and refused
  when it names a global outside CODE_PICKLE_ALLOWED (an `os.system` there is a hostile file).
- "json": `*.json` (trainer_state.json, config.json, generation_config.json, ...): parsed as JSON.
- "other": everything else (tokenizer files, text): identity only.
"""
from __future__ import annotations

import io
import pickletools
import re
import zipfile
from pathlib import PurePosixPath
from typing import Dict, List, Optional, Tuple

WEIGHTS, COMPANION, CODE_PICKLE, JSON, OTHER = "weights", "companion", "code_pickle", "json", "other"
TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt", ".bin"})
# Keys under which a torch checkpoint keeps its model weights (Lightning, common scripts, DeepSpeed).
WEIGHT_KEYS = ("state_dict", "model_state_dict", "model", "module")
NUMPY_RNG = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
             "numpy.dtype", "numpy.dtypes.UInt32DType")
_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
_COMPANIONS = frozenset({"optimizer.pt", "scheduler.pt", "scaler.pt", "optimizer.bin", "scheduler.bin"})
_CODE_PICKLES = frozenset({"training_args.bin"})
CODE_PICKLE_PREFIXES = ("transformers.", "accelerate.", "trl.", "peft.")
CODE_PICKLE_ALLOWED = re.compile(
    r"^(torch\.(device|dtype|Size|[A-Za-z]*Storage|_utils\._rebuild_[a-z0-9_]+)|collections\.OrderedDict"
    r"|_codecs\.encode|builtins\.(set|frozenset|slice)|datetime\.(timedelta|datetime|date))$")
MAX_PICKLE_SCAN_BYTES = 16 << 20


def role_of(path: str, kind: str) -> str:
    """The role of a manifest file (see the module doc)."""
    name = PurePosixPath(path).name.lower()
    suffix = PurePosixPath(name).suffix
    if name.endswith(".json"):
        return JSON
    if name in _CODE_PICKLES:
        return CODE_PICKLE
    if _RNG.match(name) or name in _COMPANIONS or re.match(r"^optimizer(_\d+)?\.(pt|bin)$", name):
        return COMPANION
    if suffix == ".safetensors" or name.startswith("pytorch_model") and suffix == ".bin":
        return WEIGHTS
    if kind == "checkpoint" and suffix in TORCH_SUFFIXES:
        return WEIGHTS
    return OTHER


def allow_list(path: str) -> Tuple[str, ...]:
    """The extra globals weights_only may build for this companion (dotted names)."""
    return NUMPY_RNG if _RNG.match(PurePosixPath(path).name.lower()) else ()


def method_text(role: str, allowed: Tuple[str, ...] = (), detail: Optional[str] = None) -> str:
    """The report's per-file "method": how the file was proven."""
    if role == WEIGHTS:
        return "weights"
    if role == COMPANION:
        shown = [a for a in allowed if not a.startswith("numpy.core.") and "UInt32DType" not in a]
        return f"safe-load (allow-list: {', '.join(shown)})" if allowed else "safe-load"
    if role == JSON:
        return "identity only (parsed as JSON)"
    if role == CODE_PICKLE:
        return f"identity only ({detail})" if detail else "identity only"
    return "identity only"


# ---- a pickle read without running it ---------------------------------------------------------------


_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                         "BINSTRING", "STRING"})
_QUIET_OPS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME", "PROTO"})


def pickle_bytes(raw: bytes) -> bytes:
    """The pickle inside a torch zip (its data.pkl), or `raw` itself (a legacy pickle)."""
    if raw[:4] != b"PK\x03\x04":
        return raw
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        names = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if not names:
            raise ValueError("a zip without data.pkl")
        info = zf.getinfo(names[0])
        if info.file_size > MAX_PICKLE_SCAN_BYTES:
            raise ValueError(f"data.pkl is {info.file_size} bytes, more than the scan reads")
        return zf.read(names[0])


def pickle_globals(data: bytes) -> List[str]:
    """Every global a pickle names ("module.name"), read with pickletools: nothing is executed.
    "<unresolved>" stands for a STACK_GLOBAL whose names are not plain strings."""
    pushes: List[Optional[str]] = []
    memo: Dict[int, Optional[str]] = {}
    found: List[str] = []
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in _STRING_OPS:
            pushes.append(arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes)
                          else None)
        elif name in ("GLOBAL", "INST"):
            found.append(str(arg).replace(" ", ".", 1))
            pushes.append(None)
        elif name == "STACK_GLOBAL":
            mod, attr = (pushes[-2], pushes[-1]) if len(pushes) >= 2 else (None, None)
            found.append(f"{mod}.{attr}" if mod and attr else "<unresolved>")
            pushes.append(None)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushes[-1] if pushes else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(str(arg))] = pushes[-1] if pushes else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushes.append(memo.get(int(str(arg))))
        elif name not in _QUIET_OPS:
            pushes.append(None)
    return sorted(set(found))


def code_pickle_verdict(raw: bytes) -> Tuple[bool, str]:
    """(passes, text) for a training_args.bin: the globals its pickle names, all expected or not."""
    try:
        names = pickle_globals(pickle_bytes(raw))
    except Exception as e:  # any parse failure of a hostile file is a refusal
        return False, f"its pickle does not parse ({type(e).__name__}: {str(e)[:120]}): refused, not loaded"
    bad = [n for n in names if not n.startswith(CODE_PICKLE_PREFIXES) and not CODE_PICKLE_ALLOWED.match(n)]
    if bad:
        return False, (f"its pickle names {', '.join(bad[:5])}, outside what a training_args.bin needs: "
                       "refused, not loaded")
    classes = sorted({n.rsplit(".", 1)[-1] for n in names if n.startswith(CODE_PICKLE_PREFIXES)},
                     key=lambda c: (not c.endswith("Arguments"), not c.endswith("Config"), c))
    shown = ", ".join(classes[:2]) + (f" and {len(classes) - 2} more" if len(classes) > 2 else "")
    return True, f"pickles code: {shown or 'nothing'}; never loaded, its globals checked"


__all__ = ["CODE_PICKLE", "COMPANION", "JSON", "OTHER", "WEIGHTS", "WEIGHT_KEYS", "allow_list",
           "code_pickle_verdict", "method_text", "pickle_globals", "role_of"]
