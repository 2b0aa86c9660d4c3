"""A real, private Slurm cluster on this machine, for the tests: munged, slurmctld and two slurmd.

    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="rgtslurm-", dir="/tmp"))).start()
    job = cluster.sbatch(script, "--output", str(out))
    cluster.wait_job(job, "COMPLETED")
    cluster.stop()

Everything lives in the cluster's root directory: a fresh munge key, munged's socket, pid, log
and seed files, the generated slurm.conf, slurmctld's state, each slurmd's spool. The daemons run
in the foreground (`munged -F`, `slurmctld -D`, `slurmd -D -N NODE`) as children of the test, with
their output in <root>/<daemon>.log, and are ended by pid. The ports are free TCP ports picked at
start. Clients (sbatch, srun, squeue, scontrol, scancel) find the cluster through SLURM_CONF, which
`cluster.env` sets; a batch job inherits it (sbatch exports the environment), so an `srun` inside
the script reaches the same controller.

Two nodes on one host: Debian's slurm-wlm is built with multiple-slurmd support, so n1 and n2
are two slurmd on 127.0.0.1, each on its own port. No cgroups (proctrack/linuxproc, task/none):
a job's processes are found by parentage, which is enough for a machine with no systemd.

Slurm needs root here: slurmd starts each job as its user, and munged trusts the key's owner.
`slurm_skip_reason()` says why a cluster cannot run (not root, slurm-wlm not installed: `make test`
installs it with sshd in its system-deps step).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import psutil

from tests.helpers import wait_until

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
INSTALL_HINT = "as root, `make system-deps` (or apt-get install -y slurm-wlm munge) installs it"
# Marks the environment of the daemons and clients this module starts, and so of the jobs those
# submit (sbatch and srun export the environment). slurmd starts each slurmstepd with an empty
# environment, re-parented to init, but in slurmd's own working directory: the cluster's root.
# Teardown finds what a cluster left behind by the two.
MARK = "RGT_TEST_SLURM_CLUSTER"
# Job states after which a job runs no more.
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.access(p, os.X_OK)), None)


def _missing() -> List[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if _which(b) is None]


def slurm_skip_reason() -> Optional[str]:
    """None when a cluster can start here; else why not (for pytest.skip). `make test` installs
    slurm-wlm and munge (its system-deps step, as root); nothing is installed from a test."""
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts jobs as their user)"
    missing = _missing()
    if missing:
        return f"slurm is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
    return None


def free_ports(count: int) -> List[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held open together, so no two are the same)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Daemon:
    """One daemon in the foreground, our child; its stdout and stderr in `log`."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Dict[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, list(argv), log, env
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> Daemon:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=self.log.parent)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = ["(no log)"]
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then wait; SIGKILL only if it will not end."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, all on 127.0.0.1, configured under `root`."""

    def __init__(self, root: Path, nodes: Iterable[str] = ("n1", "n2"), cpus: int = 2, gpus: int = 0,
                 partition: str = "debug", partition_options: str = "",
                 extra_conf: Sequence[str] = (), kill_wait: int = 2) -> None:
        """`cpus` and `gpus` are what each node says it has (slurm.conf's word is taken over the
        hardware's: SlurmdParameters=config_overrides), so a job written for a GPU node (a
        --gpus-per-node, a --cpus-per-task larger than this machine) runs unchanged. The GPUs are
        stand-ins: gres.conf names empty files under <root>/dev as their devices, so a job that asks for
        them gets CUDA_VISIBLE_DEVICES and no GPU. `partition_options` are added to the default
        partition's line (GraceTime=30), `extra_conf` lines to the end of slurm.conf (another
        partition, say one with PriorityTier=2 whose jobs preempt the default one's). `kill_wait`:
        the seconds between Slurm's SIGTERM and SIGKILL when it ends a job (KillWait; 30 on a
        real cluster, 2 here so teardown is quick)."""
        self.root = root
        self.nodes = list(nodes)
        self.cpus = cpus
        self.gpus = gpus
        self.partition_options = partition_options
        self.extra_conf = list(extra_conf)
        self.partition = partition
        self.kill_wait = kill_wait
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.host = socket.gethostname().split(".")[0]
        self.ctld_port = 0
        self.node_ports: Dict[str, int] = {}
        self.daemons: List[Daemon] = []
        self.env: Dict[str, str] = {}
        self._daemon_env: Dict[str, str] = {}

    # -- files -----------------------------------------------------------------------

    def _write_munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)   # munged wants its socket's directory searchable by all
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)

    def _write_conf(self) -> None:
        ports = free_ports(1 + len(self.nodes))
        self.ctld_port = ports[0]
        self.node_ports = dict(zip(self.nodes, ports[1:]))
        for sub in ("state", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        lines = [
            "# Generated by tests/slurm/cluster.py: a private test cluster; nothing outside this directory.",
            "ClusterName=rgttest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (120 s by
            # default); 10 s keeps a requeue test short and still covers a slow step launch.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # A job that becomes eligible later (a requeued one) starts within a second or two,
            # not at the next 30 s backfill or 60 s main-scheduler pass.
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdTimeout=30",
            "SlurmctldTimeout=30",
            "MessageTimeout=20",
            "InactiveLimit=0",
            f"KillWait={self.kill_wait}",
            "MinJobAge=600",
            "JobRequeue=1",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "SlurmdParameters=config_overrides",
        ]
        gres = ""
        if self.gpus:
            lines.append("GresTypes=gpu")
            gres = f" Gres=gpu:{self.gpus}"
            # slurmd drops a GPU with no device file: empty files stand in for /dev/nvidiaN.
            dev = self.root / "dev"
            dev.mkdir(exist_ok=True)
            for i in range(self.gpus):
                (dev / f"gpu{i}").touch()
            last = f"[0-{self.gpus - 1}]" if self.gpus > 1 else "0"
            (self.conf.parent / "gres.conf").write_text(f"Name=gpu File={dev}/gpu{last}\n")
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 "
                         f"Port={self.node_ports[node]} CPUs={self.cpus}{gres} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     f"MaxTime=INFINITE State=UP {self.partition_options}".rstrip())
        lines += self.extra_conf
        self.conf.write_text("\n".join(lines) + "\n")

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_munge()
        self._write_conf()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":   # the test's own Slurm job (if any) is not this cluster's
                del self.env[var]
        self.env[MARK] = str(self.root)
        self._daemon_env = dict(self.env)
        try:
            self._start_daemons(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: Sequence[str]) -> Daemon:
        daemon = Daemon(name, argv, self.root / f"{name}.log", self._daemon_env).start()
        self.daemons.append(daemon)
        return daemon

    def _start_daemons(self, timeout_s: float) -> None:
        m = self.munge_socket.parent
        munged = self._spawn("munged", [
            _which("munged") or "munged", "-F", "--force", f"--socket={self.munge_socket}",
            f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), 20, "munged's socket", munged)
        ctld = self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i",
                                         "-f", str(self.conf)])
        self._wait(lambda: self._scontrol_ping(), timeout_s, "slurmctld to answer", ctld)
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [_which("slurmd") or "slurmd", "-D", "-N", node,
                                          "-f", str(self.conf)])
        self._wait(self.all_idle, timeout_s, f"nodes {self.nodes} to be idle")

    def _wait(self, predicate: Callable[[], object], timeout_s: float, what: str,
              daemon: Optional[Daemon] = None) -> None:
        def ready() -> bool:
            dead = [d for d in self.daemons if not d.alive()]
            if dead:
                raise AssertionError(f"{dead[0].name} exited while waiting for {what}\n{self.logs()}")
            return bool(predicate())
        try:
            wait_until(ready, timeout_s, what, interval_s=0.2)
        except AssertionError as e:
            if "exited while" in str(e):
                raise
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def _scontrol_ping(self) -> bool:
        out = self.run("scontrol", "ping", check=False, timeout_s=20)
        return out.returncode == 0 and "UP" in out.stdout

    def node_states(self) -> Dict[str, str]:
        """Each node's state as sinfo says it (idle, alloc, mix, down*, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout_s=20)
        states = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def all_idle(self) -> bool:
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values())

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure message."""
        return "\n".join(d.tail() for d in self.daemons)

    def stop(self) -> None:
        """Cancel every job, wait for their processes to end, then end the daemons by pid."""
        leftovers: List[str] = []
        if self.daemons and self._ctld_alive():
            self.run("scancel", "--full", "--user", "root", check=False, timeout_s=30)
            try:
                wait_until(lambda: not self.jobs_alive() and not self.job_processes(), 30,
                           "every job of the cluster to end", interval_s=0.2)
            except AssertionError as e:
                leftovers.append(str(e))
        for daemon in reversed(self.daemons):   # slurmd first, munged last
            daemon.stop()
        # Whatever the daemons left (a slurmstepd or job that outlived its slurmd): end it by pid.
        stray = self.job_processes()
        for p in stray:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(stray, timeout=10)
        self.daemons = []
        if stray:
            leftovers.append(f"processes left behind: {[(p.pid, p.info.get('name')) for p in stray]}")
        assert not leftovers, "\n".join(leftovers)

    def _ctld_alive(self) -> bool:
        return any(d.name == "slurmctld" and d.alive() for d in self.daemons)

    def jobs_alive(self) -> List[str]:
        out = self.run("squeue", "-h", "-o", "%i %T", check=False, timeout_s=20)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def job_processes(self) -> List[psutil.Process]:
        """The cluster's slurmstepd processes (their working directory is the root) and every job
        process (their descendants, and whatever carries MARK=root), other than the daemons and
        the test process itself."""
        ours = {d.proc.pid for d in self.daemons if d.proc is not None} | {os.getpid()}
        root = str(self.root)
        found: Dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["name"]):
            if p.pid in ours:
                continue
            try:
                if p.info["name"] == "slurmstepd" and p.cwd() == root:
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
                elif p.environ().get(MARK) == root:
                    found[p.pid] = p
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    # -- clients ---------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, timeout_s: float = 60,
            env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        out = subprocess.run(list(cmd), env=env or self.env, capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=cwd or self.root)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
        return out

    def sbatch(self, script: Path, *args: str, env: Optional[Dict[str, str]] = None,
               cwd: Optional[Path] = None) -> str:
        """Submit; the job id."""
        out = self.run("sbatch", "--parsable", *args, str(script), env=env, cwd=cwd)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job -o ID` as a dict ({} once slurmctld forgot the job)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False, timeout_s=20)
        if out.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def job_state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_job(self, job_id: str, states: str | Tuple[str, ...], timeout_s: float = 60) -> Dict[str, str]:
        """Poll until the job is in one of `states`; fail early if it finished in another."""
        want = (states,) if isinstance(states, str) else tuple(states)
        seen: Dict[str, str] = {}

        def reached() -> bool:
            seen.clear()
            seen.update(self.job(job_id))
            state = seen.get("JobState", "")
            if state not in want and state in FINISHED:
                raise AssertionError(f"job {job_id} ended {state}, not {want}: {seen}\n{self.logs()}")
            return state in want
        try:
            wait_until(reached, timeout_s, f"job {job_id} to be {'/'.join(want)}", interval_s=0.2)
        except AssertionError as e:
            if "ended" in str(e):
                raise
            raise AssertionError(f"{e}; last: {seen}\n{self.logs()}") from None
        return dict(seen)

