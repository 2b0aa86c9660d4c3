"""Suite-wide guards: no test may leak a thread or a child process, nor arm this machine's dead-man.

Also the suite's run settings: one Hypothesis profile (derandomized by default, so a CI run is
reproducible), one compute thread for torch in every process, and, for `pytest -n N` (pytest-xdist,
`make pytest`), a short tmp_path base, which tests share a worker and which run first.
"""
from __future__ import annotations

import ast
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Set

import psutil
import pytest
from hypothesis import HealthCheck, settings

# "ci" (the default): the same examples every run, no per-example deadline (a loaded machine is
# slow, not wrong). "explore" (HYPOTHESIS_PROFILE=explore): new random examples each run, and the
# fuzz tests' full budget (tests/protocol), for hunting bugs rather than gating a change.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_SHORT_BASE = pytest.StashKey[Path]()

# One compute thread for torch in every process the tests start (jobs, frameworks, the box's
# sessions through tests/sshbox.py) and in the workers themselves. The tiny test models gain
# nothing from more, and torch's idle OpenMP threads spin between the paced steps of a job
# (--step-seconds): a job that sleeps 20 ms a step burned most of a core that way, beside the
# other tests' processes on a 2-core machine. Set here, before anything imports torch.
THREAD_VARS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for _name, _value in THREAD_VARS.items():
    os.environ.setdefault(_name, _value)
# `rgt explain` keeps its built index in the user's state directory; tests never write there
# (tests/controller/test_explain_cache.py gives the cache a place of its own).
os.environ.setdefault("RGT_EXPLAIN_CACHE", "off")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, a short base for tmp_path. Each worker's tmp_path lies in <base>/popen-gwN/, ten
    characters deeper than a plain run's, and a test's control socket in tmp_path would then pass
    the length a unix socket allows (controller.ssh puts such a socket elsewhere, and the test no
    longer sees its own directory used). /tmp/pt-XXXXXXXX/popen-gwN is shorter than pytest's
    /tmp/pytest-of-USER/pytest-N. Removed after a run that passed; kept after one that failed."""
    if os.environ.get("PYTEST_XDIST_WORKER") or config.option.basetemp:
        return
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") != "no":
        config.option.basetemp = tempfile.mkdtemp(prefix="pt-", dir="/tmp")
        config.stash[_SHORT_BASE] = Path(config.option.basetemp)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    base = session.config.stash.get(_SHORT_BASE, None)
    if base is not None and exitstatus == 0:
        shutil.rmtree(base, ignore_errors=True)


def _files_with_shared_fixtures(tests: Path) -> Set[str]:
    """Test files (posix paths from the repository root) that define a module- or session-scoped
    fixture: a framework job run once, a library built once. Read from the source, as the xdist
    controller collects nothing itself."""
    found: Set[str] = set()
    for path in sorted(tests.rglob("test_*.py")):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError:  # newer syntax than this Python's (the 3.9 leg): collection will say so
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                scope = next((k.value for k in getattr(deco, "keywords", ()) if k.arg == "scope"), None)
                if isinstance(scope, ast.Constant) and scope.value in ("module", "package", "session"):
                    found.add(path.relative_to(tests.parent).as_posix())
    return found


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: every test its own unit of work, except that the tests of a file with a
    shared fixture go to one worker together, so the fixture is made once. (xdist's own loadgroup
    groups by xdist_group marks, which it cannot apply under this pytest: it renames each item's
    nodeid through an attribute pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shared = _files_with_shared_fixtures(Path(__file__).resolve().parent)

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in shared else nodeid

    return SharedFixtureScheduling(config, log)


# The files outside tests/e2e and tests/slurm that cost the most (stock frameworks trained, real
# sidecars, daemons and box processes): marked `slow`, left out of `make test-fast` only. Measured
# with --durations=0 (the 30 heaviest, ~630 of the ~730 test-seconds outside e2e and Slurm).
SLOW_FILES = frozenset({
    "onbox/test_integrations.py", "onbox/test_framework_signals.py", "onbox/test_custody_units.py",
    "controller/test_verify_frameworks.py", "controller/test_verify.py", "onbox/test_launch.py",
    "test_rerun.py", "onbox/test_sidecar.py", "controller/test_compare.py", "onbox/test_resume_dirs.py",
    "controller/test_watcher_end.py", "onbox/test_stacks.py", "controller/test_daemon.py",
    "controller/test_deadman_cli.py", "onbox/test_deadman_clock.py", "onbox/test_follow.py",
    "onbox/test_preempt.py", "controller/test_identity.py", "onbox/test_deadman_daemon.py",
    "controller/test_teardown.py", "controller/test_subscriber.py", "controller/test_rehearse.py",
    "onbox/test_secrets_onbox.py", "onbox/test_sidecar_fuzz.py", "onbox/test_close.py",
    "controller/test_install.py", "controller/test_verify_hostile.py", "controller/test_explain_cache.py",
    "controller/test_compare_seeds.py", "onbox/test_nvml_stub.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Hand out the end-to-end tests and the real Slurm cluster's first: they are the long ones (the
    Slurm time-limit test alone waits ~90 s for its warning), and the many short tests then fill the
    workers' tails instead of one long test starting last. The SLOW_FILES' tests are marked slow."""
    here = Path(__file__).resolve().parent
    for item in items:
        try:
            rel = item.path.resolve().relative_to(here).as_posix()
        except ValueError:
            continue
        if rel in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: 0 if {"e2e", "slurm"} & set(item.path.parts) else 1)


# How long a test's threads and child processes get to end after it before they count as leaked. A
# bound, not a wait: what ended already costs nothing, and a loaded machine may take seconds to let
# a process it just signalled exit.
LEAK_GRACE_S = 30.0


def _grace_join(threads: set[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    extra = set(threading.enumerate()) - before
    _grace_join(extra, LEAK_GRACE_S)
    alive = sorted(t.name for t in extra if t.is_alive())
    assert not alive, f"test leaked threads: {alive}"


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    extra = [p for p in me.children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(extra, timeout=LEAK_GRACE_S)
    for p in alive:  # end what this test started, by pid, then fail it
        p.kill()
    assert not alive, f"test leaked processes: {[(p.pid, p.name()) for p in alive]}"


@pytest.fixture(autouse=True)
def no_deadman_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rgt-onbox launch` arms the box's dead-man (a detached daemon under ~/.rgt) unless told
    not to; tests that launch say so through RGT_DEADMAN, and dead-man tests arm one in a temp HOME."""
    monkeypatch.setenv("RGT_DEADMAN", "off")
