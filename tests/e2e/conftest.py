"""Fixtures for the end-to-end tests: the sshd box and a controller driving it."""
from tests.e2e.rgtbox import rgt_box, rgt_local
from tests.sshbox import sshbox

__all__ = ["rgt_box", "rgt_local", "sshbox"]
