"""Where a run's sidecar listens: <run>/rgt/endpoints.json.

The sidecar writes it after binding; the controller reads it (locally, or over
SSH) to know which socket paths to connect or forward. Unix socket paths are
limited to ~107 bytes, so a deep run dir gets its sockets in a short private
directory instead, and this file is how anyone finds them.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

from .errors import ProtocolError

FILENAME = "endpoints.json"


@dataclasses.dataclass(frozen=True)
class Endpoints:
    pub: str                        # ipc:///.../pub or tcp://127.0.0.1:PORT
    ctl: str                        # ipc:///.../ctl or tcp://127.0.0.1:PORT
    pid: int = 0                    # the sidecar process
    curve_server_key: Optional[str] = None   # Z85 public key when CURVE is on

    def write(self, rgt_dir: Path) -> Path:
        path = Path(rgt_dir) / FILENAME
        tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, rgt_dir: Path) -> Endpoints:
        path = Path(rgt_dir) / FILENAME
        try:
            obj = json.loads(path.read_text())
            return cls(pub=str(obj["pub"]), ctl=str(obj["ctl"]), pid=int(obj.get("pid", 0)),
                       curve_server_key=obj.get("curve_server_key"))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"{path} is not a valid endpoints file: {e}") from e
