"""Through the loopback sshd: pull, verify, and the teardown gate.

A clean run passes every proof and opens the gate. Each of these fails verify, or closes the
gate, with its own named reason: one flipped bit in the pulled copy, a malicious pickle whose
__reduce__ would create a marker file (it must never appear), a safetensors file with a lying
header, and a checkpoint written after the pull.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

from tests.e2e.rgtbox import ONBOX, Rgt
from tests.helpers import REPO, rgt_cmd, wait_until
from tests.sshbox import SshBox

pytestmark = pytest.mark.e2e

JOB = r'''
import os, sys, torch
from safetensors.torch import save_file
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
marker = sys.argv[2] if len(sys.argv) > 2 else ""

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

def commit(name, write):
    tmp = os.path.join(ckpt, "." + name + ".tmp")
    write(tmp)
    os.replace(tmp, os.path.join(ckpt, name))

kind = sys.argv[1]
if kind == "clean":
    commit("step000100.pt", lambda p: torch.save({"w": torch.ones(4), "step": 100}, p))
    commit("step000200.safetensors", lambda p: save_file({"w": torch.arange(8.0)}, p))
elif kind == "evil":
    commit("step000100.pt", lambda p: torch.save({"w": torch.zeros(2), "x": Evil()}, p))
else:  # a safetensors header that claims more bytes than the file holds
    import json, struct
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    commit("step000100.safetensors",
           lambda p: open(p, "wb").write(struct.pack("<Q", len(header)) + header + b"\0" * 16))
with open(os.environ["RGT_METRICS"], "a") as f:
    f.write('{"step": 200, "loss": 0.5}\n')
'''
LINGER = "--onbox-arg=--sidecar-linger=3s"  # custody hashes the last checkpoint before it stops


def rgt_json(rgt: Rgt, *args: str) -> Tuple[int, Dict[str, Any], str]:
    out = subprocess.run(rgt_cmd(*args, "--json"), env=rgt.env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return out.returncode, (json.loads(lines[-1]) if lines else {}), out.stderr


def launch_job(rgt: Rgt, *job_args: str) -> str:
    out = rgt("launch", "box", "--root", str(rgt.root), "--json", "--onbox-arg=--no-preflight",
              LINGER, "--onbox-arg=--serve-arg=--no-kmsg", "--", sys.executable, "-c", JOB, *job_args)
    run = str(json.loads(out.stdout.strip().splitlines()[-1])["run_id"])
    rgt.runs.append(run)
    return run


def stopped(rgt: Rgt, run: str) -> bool:
    with rgt.store() as s:
        return bool(s.events(run, kind_prefix="sidecar.stopping"))


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def tamper_the_copy(dest: Path, copy: Path) -> None:
    """One flipped bit in a copy of the real pull. Truncation, an extra and a missing file fail the
    same identity proof, each for its own reason, in tests/controller/test_verify.py."""
    shutil.copytree(dest, copy)
    flip_bit(copy / "checkpoints/step000200.safetensors")


def test_pull_verify_and_the_gate_with_every_kind_of_bad_checkpoint(rgt_box: Rgt, sshbox: SshBox,
                                                                    tmp_path: Path) -> None:
    rgt = rgt_box
    rgt("hosts", "add", "box", "--ssh", sshbox.alias, "--onbox", ONBOX, "--profile", "generic-ssh",
        "--replace")
    marker = sshbox.home / "PWNED"
    clean, evil, lying = (launch_job(rgt, "clean"), launch_job(rgt, "evil", str(marker)),
                          launch_job(rgt, "lying"))
    for run in (clean, evil, lying):
        wait_until(lambda r=run: stopped(rgt, r), 60, f"run {run} to end")

    # The clean run: pulled, every proof passes, the gate opens.
    dest = tmp_path / "pulled"
    code, pulled, err = rgt_json(rgt, "pull", clean, "--to", str(dest))
    assert code == 0, err
    assert pulled["files"] >= 3
    code, report, err = rgt_json(rgt, "verify", clean)
    assert code == 0 and report["ok"], err
    code, plan, err = rgt_json(rgt, "teardown", clean, "--plan")
    assert code == 0 and plan["gate"]["open"], plan["gate"]

    # A tampered copy of the clean pull fails verify, naming the file and the hash.
    copy = tmp_path / "flipped-bit"
    tamper_the_copy(dest, copy)
    code, report, err = rgt_json(rgt, "verify", str(copy))
    assert code == 1 and not report["ok"] and report["proofs"]["identity"]["status"] == "failed", err
    assert "sha256" in json.dumps(report["files"]), report["files"]

    # A malicious pickle from the box: refused by weights_only, and its payload never runs.
    code, _, err = rgt_json(rgt, "pull", evil, "--to", str(tmp_path / "evil"))
    assert code == 0, err
    code, report, err = rgt_json(rgt, "verify", evil)
    assert code == 1 and report["proofs"]["safe_load"]["status"] == "failed"
    assert "weights_only" in json.dumps(report["files"])
    assert not marker.exists()
    code, plan, _ = rgt_json(rgt, "teardown", evil, "--plan")
    assert not plan["gate"]["open"] and plan["gate"]["code"] == "verify_failed"

    # A lying safetensors header: the box's custody never records it (ckpt.suspect), so even a
    # pull that verifies leaves the gate closed, naming the file.
    with rgt.store() as s:
        assert s.events(lying, kind_prefix="ckpt.suspect")
    code, _, err = rgt_json(rgt, "pull", lying, "--to", str(tmp_path / "lying"))
    assert code == 0, err
    rgt_json(rgt, "verify", lying)
    code, plan, _ = rgt_json(rgt, "teardown", lying, "--plan")
    assert not plan["gate"]["open"]
    assert "step000100.safetensors" in plan["gate"]["reason"], plan["gate"]

    # A checkpoint written on the box after the pull closes the clean run's gate again. (--from:
    # the tampered copies verified above were the newest verifications of this run.)
    code, plan, _ = rgt_json(rgt, "teardown", clean, "--plan", "--from", str(dest))
    assert plan["gate"]["open"], plan["gate"]
    box_dir = rgt.run_dir(clean)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (box_dir / "checkpoints" / "step000300.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 8)
    code, plan, _ = rgt_json(rgt, "teardown", clean, "--plan", "--from", str(dest))
    assert not plan["gate"]["open"] and "step000300.safetensors" in plan["gate"]["reason"], plan["gate"]
    code, _, err = rgt_json(rgt, "teardown", clean, "--action", "destroy", "--yes", clean,
                            "--from", str(dest))
    assert code == 1 and "gate" in err.lower(), err
