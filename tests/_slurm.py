"""A one-host SLURM for the tests: munged, slurmctld and slurmd started as root in a temp folder, stopped by PID.

A missing SLURM (Debian's slurm-wlm and munge not installed, or not root) skips the tests that need it, with the reason;
CI sets DDP_SLURM_TESTS_REQUIRED=1 (.ci/run installs the packages), which turns that skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ddp_lib.launch import descendants, free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
REQUIRED = os.environ.get("DDP_SLURM_TESTS_REQUIRED") == "1"

CONF = """\
ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock,cred_expire=10
# cred_expire: a requeued job waits cred_expire + 1 s before it may start again (120 by default)
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
"""


def missing() -> str | None:
    """Why SLURM cannot run here, or None."""
    absent = [b for b in (*DAEMONS, "sbatch", "scontrol", "sinfo") if shutil.which(b) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} not found): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the SLURM daemons are started as root and this test is not root"
    return None


def _marked(marker: str) -> list[int]:
    """Every process whose environment holds `marker` (this fixture's own SLURM_CONF): slurmstepd and the job's ranks
    leave slurmd's tree (slurmstepd daemonizes), so their PIDs are found by the variable this fixture set."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                    out.append(int(d))
            except OSError:
                pass
    return out


class Slurm:
    """The running daemons; `env` is what a client command (sbatch, scontrol) needs."""

    def __init__(self, root: Path) -> None:
        self.root, self.host = root, socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []
        for sub in ("state", "spool"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))  # a key of this fixture's own: the package's may be the munge user's
        key.chmod(0o600)
        self.conf.write_text(CONF.format(host=self.host, ctld_port=free_port(), d_port=free_port(), d=root))

    def start(self) -> None:
        r = self.root
        self._spawn(["munged", "-F", "--force", f"--socket={r}/munge.sock", f"--key-file={r}/munge.key",
                     f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed", f"--log-file={r}/munged.log"])
        self._wait(lambda: (r / "munge.sock").exists(), "munged's socket", "munged.log")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() in ("idle", "mixed"),
                   "the node to be idle", "slurmd.log")

    def _spawn(self, argv: list[str]) -> None:
        self.procs.append(subprocess.Popen(argv, env=self.env, cwd=self.root, stdout=subprocess.DEVNULL,
                                           stderr=open(self.root / f"{argv[0]}.stderr", "w")))

    def _wait(self, ready, what: str, log: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in self.root.glob("*.log")) + "\n".join(
                    f"--- {f.name}\n{f.read_text()[-2000:]}" for f in self.root.glob("*.stderr"))
                raise RuntimeError(f"SLURM: waiting for {what}: {'exited: ' + ', '.join(dead) if dead else 'timed out'}"
                                   f"\n{logs}")
            time.sleep(0.5)

    def run(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess:
        """A client command against this SLURM."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")

    def wait_job(self, job: str, timeout_s: float = 600) -> str:
        """Wait until the job has ended; its final state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                return state
            time.sleep(1)
        self.run("scancel", job)
        return "still running after the test's limit (cancelled)"

    def stop(self) -> None:
        """End the daemons, then whatever of the jobs is left, each by its PID: SIGTERM, then SIGKILL."""
        for p in reversed(self.procs):  # slurmd first, munged last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    for c in descendants(p.pid):
                        _kill(c)
                    p.kill()
                    p.wait()
        for pid in _marked(f"SLURM_CONF={self.conf}"):
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def slurm():
    """A started one-host SLURM (2 CPUs, partition `test`), stopped at the end of the module."""
    why = missing()
    if why:
        if REQUIRED:
            pytest.fail(f"DDP_SLURM_TESTS_REQUIRED=1 but {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="ddp-slurm-"))
    s = Slurm(root)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        shutil.rmtree(root, ignore_errors=True)
