"""HealthMonitor end to end over its seams: scripted GPUs, fake processes/cgroups/statvfs, a fake clock.

Each scripted scenario must yield exactly the expected events (kind, severity, count) and no others.
Time moves only when a test moves it; the only real waits are bounded waits on events.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from onbox.detectors.gpu import GpuThresholds
from onbox.errors import ConfigError
from onbox.monitors.health import HealthMonitor, MonitorConfig
from onbox.sources import fake_gpu
from onbox.sources.fake_gpu import ScriptedProbe, h100_pci
from onbox.sources.gpu import GpuProcess
from onbox.sources.host import CgroupReader
from onbox.sources.process import ProcessView, ProcInfo, start_ticks
from tests.helpers import Clock
from tests.helpers import Recorder as BaseRecorder

WAIT_S = 30.0  # a bound on waits for what must happen; a passing test never waits it out
JOB = 4242  # the fake scenarios put pids 4242+i on GPU i
JOB_TREE = {JOB + i for i in range(8)}


class Recorder(BaseRecorder):
    wait_s = WAIT_S

    def counts(self) -> Dict[Tuple[str, Optional[str]], int]:
        return dict(collections.Counter((k, s) for k, _, s in self.events))



class FakeProcesses:
    """`ProcessSource` with a fixed world: which pids live, the job's tree, what is visible."""

    def __init__(self, alive: Optional[Dict[int, float]] = None, tree: Optional[Set[int]] = None,
                 visible: Optional[Set[int]] = None, ticks: Optional[Dict[int, int]] = None) -> None:
        self.alive = dict(alive or {})
        self.ticks = dict(ticks or {})
        self.tree_pids = set(tree or set())
        self.visible_pids = set(visible if visible is not None else self.tree_pids)
        self.tree_calls = 0

    def info(self, pid: int) -> Optional[ProcInfo]:
        created = self.alive.get(pid)
        return None if created is None else ProcInfo(pid, created, "python", 1 << 30, self.ticks.get(pid))

    def tree(self, pid: int) -> Set[int]:
        self.tree_calls += 1
        return set(self.tree_pids) if pid in self.alive else set()

    def visible(self, pid: int) -> bool:
        return pid in self.visible_pids

    def holds_gpu(self, pid: int) -> Optional[bool]:
        return True

    def name(self, pid: int) -> Optional[str]:
        return None


class Rig:
    """A monitor wired to fakes; `step()` is one second: sample, then move script and clocks."""

    def __init__(self, tmp_path: Path, probe: Optional[ScriptedProbe], *, job_pid: Optional[int] = None,
                 processes: Any = None, gpu: str = "auto", **config: Any) -> None:
        self.probe = probe
        self.mono = Clock(1000.0)
        self.rec = Recorder()
        self.run_dir = tmp_path / "run"
        self.cg = tmp_path / "cg"
        self.proc = tmp_path / "proc"
        self.stat_result = SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=1000, f_bfree=500,
                                           f_bavail=500, f_files=1000, f_ffree=900, f_favail=900)
        config.setdefault("kmsg", False)
        config.setdefault("gpu_sample_s", 1.0)
        self.config = MonitorConfig(run_dir=self.run_dir, job_pid=job_pid, gpu=gpu, **config)
        self.processes = processes if processes is not None else FakeProcesses(
            {job_pid: 1.7e9} if job_pid else {}, JOB_TREE if job_pid else set())
        self.mon = HealthMonitor(self.config, self.rec, clock=Clock(1.7e9), monotonic=self.mono,
                                 probe=probe, processes=self.processes,
                                 cgroups=CgroupReader(root=self.cg, proc=self.proc),
                                 stat=lambda p: self.stat_result, host_memory=lambda: (1000, 900),
                                 boot_id=lambda: "boot-1")

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.mon.gpu_tick()
            if self.probe is not None:
                self.probe.advance()
            self.mono.t += 1.0

    def close(self) -> None:
        self.mon.close()


@pytest.fixture
def rigs() -> Any:
    made: List[Rig] = []

    def make(*args: Any, **kwargs: Any) -> Rig:
        rig = Rig(*args, **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


# ---- the scripted scenarios -------------------------------------------------------------------------


def test_healthy_h100x8_gives_only_telemetry(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, fake_gpu.healthy_h100x8(), job_pid=JOB)
    rig.mon.start()
    rig.step(61)
    rig.close()
    assert rig.rec.counts() == {("job.started", None): 1, ("gpu.sample", None): 16}
    first = rig.rec.of("gpu.sample")[0]
    assert first["gpu"] == 0 and first["samples"] == 30 and first["window_s"] == 30.0
    assert first["utilization_gpu_pct"]["min"] >= 96
    assert first["memory_total_bytes"] == fake_gpu.H100_MEMORY_TOTAL_BYTES
    assert first["processes"] == [{"pid": JOB, "used_memory_bytes": 70_500 * fake_gpu.MIB, "name": None,
                                   "job": True}]
    assert sorted(d["gpu"] for d in rig.rec.of("gpu.sample")[:8]) == list(range(8))


def test_xid79_on_gpu3_is_one_fatal_xid_and_one_lost(tmp_path: Path, rigs: Any) -> None:
    probe = fake_gpu.xid79_on_gpu3()
    rig = rigs(tmp_path, probe, job_pid=JOB)
    rig.mon.start()
    rig.step(4)  # the Xid becomes due at tick 3
    rig.rec.wait_for("gpu.xid")
    rig.step(27)
    rig.close()
    assert rig.rec.counts() == {("job.started", None): 1, ("gpu.xid", "critical"): 1,
                                ("gpu.lost", "critical"): 1, ("gpu.sample", None): 8}
    xid = rig.rec.of("gpu.xid")[0]
    assert (xid["gpu"], xid["code"], xid["class"], xid["fatal"]) == (3, 79, "node_reboot", True)
    assert xid["source"] == "nvml"
    assert xid["pci"] == "0000:5d:00" and "re-rent" in xid["advice"]
    lost = rig.rec.of("gpu.lost")[0]
    assert lost["gpu"] == 3 and lost["pci"] == h100_pci(3) and lost["evidence"] in ("sample", "xid79")
    gpu3 = [d for d in rig.rec.of("gpu.sample") if d["gpu"] == 3][0]
    assert gpu3["lost"] == 27 and gpu3["samples"] == 30


def test_kernel_log_copy_of_an_xid_wins_the_dedupe_and_carries_pid_and_name(tmp_path: Path,
                                                                             rigs: Any) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    probe = fake_gpu.xid79_on_gpu3()
    rig = rigs(tmp_path, probe, job_pid=JOB, kmsg=True, kmsg_path=str(kmsg))
    rig.mon.start()
    assert [j.name for j in rig.mon.jobs()] == ["gpu", "job", "kmsg", "disk"]
    rig.step(2)  # the script is at tick 2; the Xid comes due with the next advance
    with open(kmsg, "a") as f:
        f.write("3,900,12345678,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=4245, name=python3, "
                "GPU has fallen off the bus.\n")
        f.write("14,901,12345679,-;NVRM: Xid (PCI:0000:5d:00): 48, pid=1, name=spoof, user space\n")
    rig.step(2)
    rig.rec.wait_for("gpu.xid")
    rig.mon.kmsg_tick()
    rig.close()
    xids = rig.rec.of("gpu.xid")
    assert len(xids) == 1 and rig.mon.status()["xid_suppressed"] == 1
    assert (xids[0]["source"], xids[0]["pid"], xids[0]["process_name"]) == ("kmsg", 4245, "python3")
    assert len(rig.rec.of("gpu.lost")) == 1


def test_thermal_blips_shorter_than_the_onset_with_long_breaks_never_raise_a_throttle(
        tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, fake_gpu.thermal_throttle_flapping(ticks=80, on_ticks=2, off_ticks=6))
    rig.mon.start()
    rig.step(79)
    rig.close()
    assert set(rig.rec.counts()) == {("gpu.sample", None)}   # the soak's thermal_throttle_flapping_long
    hot = [d for d in rig.rec.of("gpu.sample") if d["gpu"] == fake_gpu.THROTTLE_GPU]
    assert any(d["clock_event_reasons"] for d in hot)   # the blips were there


def test_thermal_throttle_that_flaps_is_one_onset_and_one_clear(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, fake_gpu.thermal_throttle_flapping(ticks=40))  # throttled on even ticks 2..38
    rig.mon.start()
    rig.step(12)
    assert rig.rec.counts() == {}
    rig.step(1)  # t=12: ten seconds since the first throttled sample at t=2
    assert rig.rec.counts() == {("gpu.throttle", "warn"): 1}
    rig.step(55)  # last throttled at t=38; cleared at t=68
    assert ("gpu.throttle_cleared", "info") not in rig.rec.counts()
    rig.step(1)
    rig.step(23)
    rig.close()
    assert rig.rec.counts() == {("gpu.throttle", "warn"): 1, ("gpu.throttle_cleared", "info"): 1,
                                ("gpu.sample", None): 24}
    onset, cleared = rig.rec.of("gpu.throttle")[0], rig.rec.of("gpu.throttle_cleared")[0]
    assert onset["gpu"] == fake_gpu.THROTTLE_GPU and onset["held_s"] == 10.0
    assert onset["reasons"] == ["SwThermalSlowdown", "HwThermalSlowdown", "SmClockLowWhileHot"]
    assert cleared["throttled_s"] == 56.0
    gpu5 = [d for d in rig.rec.of("gpu.sample") if d["gpu"] == fake_gpu.THROTTLE_GPU][0]
    assert gpu5["clock_event_reasons"] == 0x60 and gpu5["violation_thermal_ns_delta"] > 0


def test_gpu_lost_mid_run_is_one_lost_and_no_degraded(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, fake_gpu.gpu_lost_mid_run())
    rig.mon.start()
    rig.step(40)
    rig.close()
    assert rig.rec.counts() == {("gpu.lost", "critical"): 1, ("gpu.sample", None): 1}
    assert rig.rec.of("gpu.lost")[0]["evidence"] == "sample"
    assert "GPU is lost" in rig.rec.of("gpu.lost")[0]["detail"]


def test_not_supported_everywhere_gives_telemetry_with_nulls_and_no_alarms(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, fake_gpu.not_supported_everywhere(), job_pid=JOB)
    rig.mon.start()
    rig.step(40)
    rig.close()
    assert rig.rec.counts() == {("job.started", None): 1, ("gpu.sample", None): 2}
    sample = rig.rec.of("gpu.sample")[0]
    assert sample["temperature_c"] is None and sample["clock_event_reasons"] is None
    assert sample["samples"] == 30 and sample["errors"] == 0
    assert rig.mon.capability().missing_functions


def test_nvml_hang_is_one_degraded_then_one_recovered(tmp_path: Path, rigs: Any) -> None:
    probe = fake_gpu.nvml_hang(ticks=8, at_tick=2)
    rig = rigs(tmp_path, probe, gpu_round_timeout_s=0.5)
    rig.mon.start()
    rig.step(3)  # t=2: GPU 0 hangs; the round is abandoned after 0.5 s
    assert rig.rec.counts() == {("sidecar.degraded", "warn"): 1}
    degraded = rig.rec.of("sidecar.degraded")[0]
    assert degraded["part"] == "nvml" and degraded["gpus"] == [fake_gpu.HANG_GPU]
    rig.step(2)  # still stuck: the scheduler is not blocked and nothing repeats
    assert rig.mon.status()["gpu"]["stuck"]
    probe.release()
    assert rig.mon.wait_gpu_idle(WAIT_S)
    rig.step(9)  # t=5..13: clean rounds, but not yet ten seconds clean since the last failing (t=4)
    assert ("sidecar.recovered", "info") not in rig.rec.counts()
    rig.step(1)
    rig.step(26)
    rig.close()
    assert rig.rec.counts() == {("sidecar.degraded", "warn"): 1, ("sidecar.recovered", "info"): 1,
                                ("gpu.sample", None): 8}


# ---- without a GPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["none", "auto"])
def test_no_driver_turns_the_gpu_section_off_and_the_rest_runs(tmp_path: Path, rigs: Any, gpu: str) -> None:
    rig = rigs(tmp_path, None, gpu=gpu, job_pid=JOB, processes=FakeProcesses({JOB: 1.7e9}, {JOB}))
    rig.mon.start()
    cap = rig.mon.capability()
    assert not cap.available and cap.reason
    assert [j.name for j in rig.mon.jobs()] == ["job", "disk"]
    for job in rig.mon.jobs():
        job.run()
    rig.close()
    assert rig.rec.counts() == {("job.started", None): 1, ("disk.sample", None): 1}
    assert not [t for t in threading.enumerate() if t.name in ("rgt-xid", "rgt-gpu-sampler")]


def test_bad_gpu_setting_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown fake GPU scenario"):
        HealthMonitor(MonitorConfig(run_dir=tmp_path, gpu="fake:nope"), lambda *a: None)
    with pytest.raises(ConfigError):
        HealthMonitor(MonitorConfig(run_dir=tmp_path, gpu="cuda"), lambda *a: None)


def test_fake_scenario_by_name_advances_itself(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, None, gpu="fake:gpu_lost_mid_run", gpu_sample_s=2.0)
    rig.mon.start()
    for _ in range(3):
        rig.mon.gpu_tick()  # ticks 0, 2, 4: lost from tick 4
    rig.close()
    assert rig.rec.counts() == {("gpu.lost", "critical"): 1}


# ---- foreign memory ----------------------------------------------------------------------------------


def test_foreign_vram_holder_onset_and_clear(tmp_path: Path, rigs: Any) -> None:
    probe = fake_gpu.healthy_h100x8(ticks=1)
    stranger = GpuProcess(pid=777, used_memory_bytes=2 << 30, name="zombie")
    hidden = GpuProcess(pid=999_999, used_memory_bytes=4 << 30)  # a host pid invisible here
    rows = probe._ticks[0]
    rows[2] = fake_gpu.h100_sample(2, 0, processes=rows[2].processes + (stranger, hidden))  # type: ignore
    procs = FakeProcesses({JOB: 1.7e9}, JOB_TREE, visible=JOB_TREE | {777})
    rig = rigs(tmp_path, probe, job_pid=JOB, processes=procs)
    rig.mon.start()
    rig.step(10)
    assert rig.rec.counts() == {("job.started", None): 1}
    rig.step(1)
    onset = rig.rec.of("gpu.foreign_memory")
    assert len(onset) == 1 and onset[0]["gpu"] == 2 and onset[0]["pids"] == [777]
    assert onset[0]["bytes"] == 2 << 30 and onset[0]["state"] == "onset"
    rig.step(20)
    gpu2 = [d for d in rig.rec.of("gpu.sample") if d["gpu"] == 2][0]
    assert [(p["pid"], p["job"]) for p in gpu2["processes"]] == [(JOB + 2, True), (777, False),
                                                                 (999_999, None)]
    rows[2] = fake_gpu.h100_sample(2, 0)
    rig.step(29)
    assert ("gpu.foreign_memory_cleared", "info") not in rig.rec.counts()
    rig.step(1)  # last seen at t=30: cleared at t=60
    rig.close()
    assert rig.rec.counts() == {("job.started", None): 1, ("gpu.foreign_memory", "warn"): 1,
                                ("gpu.foreign_memory_cleared", "info"): 1, ("gpu.sample", None): 16}
    assert procs.tree_calls <= 13  # the walk is rate-limited (5 s), not once per round


# ---- the job ------------------------------------------------------------------------------------------


def _write_cgroup(rig: Rig, pid: int, current: int, limit: str, oom_kill: int,
                  inactive_file: int = 0) -> None:
    (rig.proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (rig.proc / str(pid) / "cgroup").write_text("0::/job\n")
    leaf = rig.cg / "job"
    leaf.mkdir(parents=True, exist_ok=True)
    (leaf / "memory.current").write_text(f"{current}\n")
    (leaf / "memory.max").write_text(f"{limit}\n")
    (leaf / "memory.events").write_text(f"oom 0\noom_kill {oom_kill}\n")
    (leaf / "memory.stat").write_text(f"anon {current - inactive_file}\ninactive_file {inactive_file}\n")


def test_memory_pressure_and_oom_kill_while_the_job_lives(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, None, gpu="none", job_pid=JOB)
    _write_cgroup(rig, JOB, 960, "1000", 0, inactive_file=200)  # mostly droppable page cache
    rig.mon.start()
    rig.mon.job_tick()
    assert rig.rec.counts() == {("job.started", None): 1}
    _write_cgroup(rig, JOB, 950, "1000", 0)
    rig.mono.t += 1
    rig.mon.job_tick()
    _write_cgroup(rig, JOB, 960, "1000", 1)
    rig.mono.t += 1
    rig.mon.job_tick()
    _write_cgroup(rig, JOB, 100, "1000", 1)
    for _ in range(31):
        rig.mono.t += 1
        rig.mon.job_tick()
    assert rig.rec.counts() == {("job.started", None): 1, ("mem.pressure", "warn"): 1,
                                ("mem.pressure", "critical"): 1, ("mem.ok", "info"): 1}
    onset, oom = rig.rec.of("mem.pressure")
    cleared, = rig.rec.of("mem.ok")
    assert onset["scope"] == "cgroup" and onset["used_pct"] == 95.0 and onset["pid"] == JOB
    assert oom["reason"] == "oom_kill" and oom["oom_kill_delta"] == 1
    assert cleared["state"] == "cleared"


def test_unlimited_cgroup_falls_back_to_host_memory(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path, None, gpu="none", job_pid=JOB)
    _write_cgroup(rig, JOB, 500, "max", 0)
    rig.mon.start()
    reading = rig.mon.read_memory()
    assert reading is not None and reading.scope == "host" and reading.used_pct == 10.0
    assert reading.oom_kill == 0


@pytest.fixture
def child() -> Any:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def test_real_job_exit_with_the_launchers_record_once_across_restarts(tmp_path: Path, rigs: Any,
                                                                       child: Any) -> None:
    rig = rigs(tmp_path, None, gpu="none", job_pid=child.pid, processes=ProcessView())
    rig.mon.start()
    rig.mon.job_tick()
    assert rig.rec.counts() == {("job.started", None): 1}
    assert rig.rec.of("job.started")[0]["alive"]
    _end(child)
    record = {"code": None, "signal": 15, "oom_killed": False}
    (rig.run_dir / "rgt" / "exit.json").write_text(json.dumps(record))
    rig.mon.job_tick()
    rig.mon.job_tick()
    assert rig.rec.counts() == {("job.started", None): 1, ("job.exited", "warn"): 1}
    exited = rig.rec.of("job.exited")[0]
    assert (exited["pid"], exited["code"], exited["signal"]) == (child.pid, None, 15)
    assert not exited["vanished"]
    again = rigs(tmp_path, None, gpu="none", job_pid=child.pid, processes=ProcessView())
    again.mon.start()
    again.mon.job_tick()
    assert again.rec.events == []  # a restarted sidecar neither re-announces nor re-reports


def test_vanished_job_waits_for_the_record_then_reports_with_evidence(tmp_path: Path, rigs: Any,
                                                                      child: Any) -> None:
    rig = rigs(tmp_path, None, gpu="none", job_pid=child.pid, processes=ProcessView(), exit_grace_s=3.0)
    _write_cgroup(rig, child.pid, 10, "1000", 5)
    rig.mon.start()
    rig.mon.job_tick()
    _write_cgroup(rig, child.pid, 10, "1000", 6)
    _end(child)
    rig.mon.job_tick()
    rig.mono.t += 2.9
    rig.mon.job_tick()
    assert not rig.rec.of("job.exited")
    rig.mono.t += 0.1
    rig.mon.job_tick()
    assert rig.rec.counts()[("job.exited", "critical")] == 1
    exited = rig.rec.of("job.exited")[0]
    assert exited["vanished"] and exited["code"] is None and exited["oom_killed"]
    assert exited["evidence"] == {"exit_record": False, "oom_kill_delta": 1, "rebooted": False,
                                  "signal": None}


def test_a_reboot_or_a_reused_pid_means_the_job_is_gone(tmp_path: Path, rigs: Any) -> None:
    rgt = tmp_path / "run" / "rgt"
    rgt.mkdir(parents=True)
    (rgt / "job.announced").write_text(json.dumps({"pid": JOB, "create_time": 1.7e9, "boot_id": "boot-0"}))
    rig = rigs(tmp_path, None, gpu="none", job_pid=JOB)  # the fake world has pid JOB alive
    rig.mon.start()
    rig.mon.job_tick()
    assert rig.rec.counts() == {("job.exited", "critical"): 1}
    assert rig.rec.of("job.exited")[0]["evidence"]["rebooted"] is True
    (rgt / "job.exit_reported").unlink()
    (rgt / "job.announced").write_text(json.dumps({"pid": JOB, "create_time": 1.6e9, "boot_id": "boot-1"}))
    reused = rigs(tmp_path, None, gpu="none", job_pid=JOB, exit_grace_s=0.0)
    reused.mon.start()
    reused.mon.job_tick()
    assert reused.rec.counts() == {("job.exited", "warn"): 1}
    assert reused.rec.of("job.exited")[0]["vanished"]


def test_a_stepped_wall_clock_is_the_same_job_and_other_start_ticks_are_a_reused_pid(
        tmp_path: Path, rigs: Any) -> None:
    """psutil's create_time moves with /proc/stat's btime whenever the clock is stepped; the start
    ticks do not. A loaded VM here drifted 14 s in 10 minutes and every job looked vanished."""
    procs = FakeProcesses({JOB: 1.7e9}, {JOB}, ticks={JOB: 5000})
    rig = rigs(tmp_path, None, gpu="none", job_pid=JOB, processes=procs, exit_grace_s=0.0)
    rig.mon.start()
    rig.mon.job_tick()
    marker = json.loads((tmp_path / "run" / "rgt" / "job.announced").read_text())
    assert marker["start_ticks"] == 5000
    procs.alive[JOB] = 1.7e9 + 2.0   # the wall clock was stepped: the same process
    rig.mon.job_tick()
    assert rig.rec.of("job.exited") == []
    procs.alive[JOB], procs.ticks[JOB] = 1.7e9, 5001   # the pid now names a newer process
    rig.mon.job_tick()
    assert rig.rec.of("job.exited")[0]["vanished"]


def test_the_start_ticks_of_a_real_process_are_its_own(tmp_path: Path) -> None:
    me = ProcessView().info(os.getpid())
    assert me is not None and me.start_ticks is not None and me.start_ticks == start_ticks(os.getpid())
    assert start_ticks(os.getpid(), proc=str(tmp_path)) is None


# ---- disk ----------------------------------------------------------------------------------------------


def test_disk_low_escalation_ok_and_low_rate_samples(tmp_path: Path, rigs: Any) -> None:
    watched = tmp_path / "ckpt"
    watched.mkdir()
    rig = rigs(tmp_path, None, gpu="none", watch_paths=[watched], disk_poll_s=10.0, disk_report_s=60.0)
    rig.run_dir.mkdir(parents=True)
    rig.mon.start()
    assert [j.name for j in rig.mon.jobs()] == ["disk"]

    def tick(bfree: int, ffree: int = 900) -> None:
        rig.stat_result.f_bfree = rig.stat_result.f_bavail = bfree
        rig.stat_result.f_ffree = rig.stat_result.f_favail = ffree
        rig.mon.disk_tick()
        rig.mono.t += 10

    for bfree in (500, 300, 150, 80, 20, 50):
        tick(bfree)
    assert [(k, s) for k, _, s in rig.rec.events if k != "disk.sample"] == [
        ("disk.low", "warn"), ("disk.low", "critical")]
    low = rig.rec.of("disk.low")[0]
    assert low["resource"] == "bytes" and low["used_pct"] == 92.0 and low["eta_to_full_s"] > 0
    assert low["paths"] == [str(rig.run_dir), str(watched)]  # one filesystem, one detector
    for _ in range(4):
        tick(500, ffree=20)
    counts = rig.rec.counts()
    assert counts[("disk.ok", "info")] == 1 and counts[("disk.low", "critical")] == 2
    assert rig.rec.of("disk.low")[-1]["resource"] == "inodes"
    assert counts[("disk.sample", None)] == 2  # at t=0 and t=60
    assert rig.rec.of("disk.sample")[0]["filesystems"][0]["used_pct"] == 50.0


def test_thresholds_are_configurable(tmp_path: Path, rigs: Any) -> None:
    fast = GpuThresholds(throttle_onset_s=2.0, throttle_clear_s=3.0)
    rig = rigs(tmp_path, fake_gpu.thermal_throttle_flapping(ticks=6), gpu_thresholds=fast)
    rig.mon.start()
    rig.step(12)
    rig.close()
    assert rig.rec.counts() == {("gpu.throttle", "warn"): 1, ("gpu.throttle_cleared", "info"): 1}


def test_recent_gpu_util_averages_the_latest_samples(tmp_path: Path) -> None:
    from onbox.sources import fake_gpu

    mon = HealthMonitor(MonitorConfig(run_dir=tmp_path, gpu="none", kmsg=False), lambda *a: None,
                        probe=fake_gpu.healthy_h100x8())
    mon.start()
    try:
        assert mon.recent_gpu_util() is None
        mon.gpu_tick()
        util = mon.recent_gpu_util()
        assert util is not None and 0 < util <= 100
    finally:
        mon.close()
