"""A private two-node SLURM cluster on this host for the tests (Debian's slurmctld, slurmd,
slurm-client and munge; installed here when missing and we are root).

    with LocalSlurm(tmp_dir) as cluster:       # ~2 s to idle
        job = cluster.sbatch([...script, args], env)
        cluster.wait(job, timeout=300)          # -> the job's final state

Two nodes, ``node1`` and ``node2``, both this host (NodeAddr 127.0.0.1, one slurmd each on its own
port), 2 CPUs each; a private slurm.conf via SLURM_CONF (the system's /etc/slurm is left alone)
and a private munged on its own socket (``AuthInfo=socket=...``), so two suites on one machine
never share a daemon that one of them stops; torn down with ``scontrol shutdown`` and that munged
stopped.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["slurmctld", "slurmd", "sbatch", "scontrol", "munged"]


def install_reason() -> str | None:
    """None when SLURM is usable, else why it cannot be (the tests then skip with it)."""
    if all(shutil.which(t) or os.path.exists(f"/usr/sbin/{t}") for t in TOOLS):
        return None
    if os.geteuid() != 0:
        return "SLURM is not installed and installing it needs root (apt-get install " + " ".join(PACKAGES) + ")"
    if not shutil.which("apt-get"):
        return "SLURM is not installed and this machine has no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    for cmd in (["apt-get", "update", "-qq"], install):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"installing SLURM failed: {' '.join(cmd)}: {exc}"
        if proc.returncode:
            return f"installing SLURM failed: {' '.join(cmd)}: {(proc.stdout + proc.stderr)[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, workdir: str):
        self.dir = os.path.abspath(workdir)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        # munged checks that its socket's and files' directories belong to the munge user and are
        # not writable by others: /run/munge is such a directory, a test's tmp dir is not.
        tag = f"fpscale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.munge_socket = f"/run/munge/{tag}.socket"
        self.munge_files = {"pid-file": f"/run/munge/{tag}.pid", "seed-file": f"/run/munge/{tag}.seed",
                            "log-file": f"/run/munge/{tag}.log"}
        self.munged_started = False

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalSlurm":
        os.makedirs(self.dir, exist_ok=True)
        self._write_conf()
        try:
            self._start_munge()
            self._run(["slurmctld", "-f", self.conf])
            for node in ("node1", "node2"):
                self._run(["slurmd", "-f", self.conf, "-N", node])
            self._wait_idle(timeout=60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=60)
        for pidfile in ("slurmctld.pid", "slurmd.node1.pid", "slurmd.node2.pid"):
            self._kill_pidfile(os.path.join(self.dir, pidfile), wait=10)
        if self.munged_started:
            self._kill_pidfile(self.munge_files["pid-file"], wait=5)
            for path in (self.munge_socket, self.munge_socket + ".lock", *self.munge_files.values()):
                try:
                    os.remove(path)
                except OSError:
                    pass

    def _start_munge(self) -> None:
        """Start this cluster's own munged (never the machine's: another suite may stop or use that)."""
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        if not os.path.exists("/etc/munge/munge.key"):
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/mungekey", "--create"], check=True)
        options = [f"--socket={self.munge_socket}", *(f"--{k}={v}" for k, v in self.munge_files.items())]
        proc = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", *options],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode:
            raise RuntimeError(f"munged {' '.join(options)} failed: {proc.stdout}{proc.stderr}")
        self.munged_started = True
        probe = subprocess.run(["munge", "-n", "-S", self.munge_socket], capture_output=True, timeout=30)
        if probe.returncode:
            raise RuntimeError(f"munged on {self.munge_socket} does not answer: {probe.stderr.decode()}")

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        host = socket.gethostname()
        ports = [_free_port() for _ in range(3)]
        text = f"""ClusterName=fpscaletest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[1]} CPUs=2 RealMemory=8000
NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[2]} CPUs=2 RealMemory=8000
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        with open(self.conf, "w") as fh:
            fh.write(text)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        states = ""
        while time.time() < deadline:
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = proc.stdout.strip()
            if proc.returncode == 0 and states and all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the local SLURM cluster did not become idle in {timeout} s: {states!r}\n"
                           f"{self.logs()}")

    def _run(self, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stdout}{proc.stderr}\n{self.logs()}")

    @staticmethod
    def _kill_pidfile(path: str, wait: float) -> None:
        try:
            pid = int(open(path).read().strip())
        except (OSError, ValueError):
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                return
            time.sleep(0.1)
        try:
            os.kill(pid, 9)
        except OSError:
            pass

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.node1.log", "slurmd.node2.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                out.append(f"--- {name}\n" + open(path).read()[-2000:])
        return "\n".join(out)

    # -- jobs --------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | None = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stdout}{proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True,
                             text=True, timeout=30).stdout
        fields = {}
        for item in out.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields.setdefault(k, v)
        return fields

    def wait(self, job_id: str, timeout: float, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                       "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        deadline = time.time() + timeout
        info = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in done:
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True)
        raise AssertionError(f"job {job_id} did not finish within {timeout} s (cancelled): {info}\n{self.logs()}")

    def start_requeued_now(self, job_id: str, timeout: float) -> dict:
        """Wait for the job's requeue (Restarts >= 1 and PENDING again), then shorten the delay SLURM
        puts before a requeued job may start again (scheduling policy, not what the tests check).

        Not to zero: slurmd revoked the killed instance's job credential, and it refuses a credential
        created in the same whole second as that revocation ("Job credential revoked"; SLURM's own
        delay is the credential lifetime). The revocation happened before the job was PENDING, so a
        start two seconds after we see PENDING gets a credential from a later second."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if int(info.get("Restarts", "0")) >= 1 and info.get("JobState") == "PENDING":
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], env=self.env,
                               check=True, capture_output=True, timeout=30)
                return info
            time.sleep(0.2)       # a requeue passes through a finished state first: wait for PENDING
        raise AssertionError(f"job {job_id} was not requeued within {timeout} s: {self.job(job_id)}")

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], env=self.env, check=True, capture_output=True, timeout=30)
