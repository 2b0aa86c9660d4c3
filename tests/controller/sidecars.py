"""A real sidecar serving on a thread of the test process: the box side of the follow tests."""
from __future__ import annotations

import threading
from pathlib import Path

from onbox.sidecar.server import Sidecar, SidecarConfig
from protocol.endpoints import Endpoints


class RealSidecar:
    """Serves RUN_DIR's sockets; the test emits its events. It answers for `run` (default: the
    directory's name) as host `host`. close() may be called twice."""

    def __init__(self, run_dir: Path, host: str = "box", run: str = "") -> None:
        self.run_dir = run_dir
        self.sidecar = Sidecar(SidecarConfig(run_dir=run_dir, run_id=run, host=host, heartbeat_s=3600,
                                             gpu="none", kmsg=False))
        self.sidecar.start()
        self.thread = threading.Thread(target=self.sidecar.serve, name="test-serve")
        self.thread.start()

    def endpoints(self) -> Endpoints:
        return Endpoints.read(self.run_dir / "rgt")

    def close(self) -> None:
        if self.thread.is_alive():
            self.sidecar.stop()
            self.thread.join(10)
            self.sidecar.close()
