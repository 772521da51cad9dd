"""A one-node SLURM cluster on this host, to run the SLURM path (``hydra/launcher=slurm``) before a real cluster.

``make cluster`` / ``python -m mergescope.cluster start`` writes one ``slurm.conf`` for this host (its CPUs and memory
from ``slurmd -C``, one ``debug`` partition, ``auth/munge``, ``select/cons_tres``) under an ignored project folder
(``.cluster``), generates a MUNGE key there (``secret/munge.key``, folder 700, key 600, never printed), and starts
``munged``, ``slurmctld`` and ``slurmd`` with their sockets, PIDs, state, spool and logs in that folder. ``make
cluster-stop`` cancels what is still queued, waits for the job steps to end, and stops the three daemons by PID.
``make cluster-env`` prints the two lines a shell needs to submit to it (``SLURM_CONF`` and ``PATH``).

Nothing listens beyond this host except slurmctld's port: munged is a Unix socket in the folder, slurmd binds
127.0.0.1 (``CommunicationParameters=NoInAddrAny``); slurmctld 22.05 binds every address for its port whatever
the configuration says (its clients still reach it at 127.0.0.1, and every request needs a MUNGE credential from
this host's key).

The cluster keeps no accounting database, so ``sacct`` (which submitit polls for a job's state) answers from
``scontrol`` through a small script in ``bin/`` put first on ``PATH``; finished jobs stay known for an hour
(``MinJobAge``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergescope.errors import MergescopeError
from mergescope.server import free_port, pid_alive, stop_pid

HOST = "127.0.0.1"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cluster"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
INSTALL = "apt-get install -y slurm-wlm munge"
DAEMONS = ("slurmd", "slurmctld", "munged")  # stopped in this order

SACCT = '''#!/usr/bin/env python3
"""sacct for a cluster with no accounting database: JobID|State|NodeList for the -j jobs, read from scontrol
(written by mergescope.cluster; submitit polls this for its jobs' states)."""
import subprocess, sys

args = sys.argv[1:]
jobs = args[args.index("-j") + 1].split(",") if "-j" in args else []
print("JobID|State|NodeList")
seen = set()
for job in jobs:
    base = job.split("_")[0]
    if base in seen:
        continue
    seen.add(base)
    out = subprocess.run(["scontrol", "show", "job", "-o", base], capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "JobId" not in f:
            continue
        jid = f["ArrayJobId"] + "_" + f["ArrayTaskId"] if f.get("ArrayTaskId") else f["JobId"]
        if "[" not in jid and "-" in jid.split("_")[-1]:
            jid = jid.split("_")[0] + "_[" + jid.split("_")[1] + "]"
        print(jid + "|" + f.get("JobState", "UNKNOWN") + "|" + f.get("NodeList", ""))
'''


class Layout:
    """Where a cluster's pieces live under its folder."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.key = self.root / "secret" / "munge.key"         # folder 700, key 600
        self.run = self.root / "run"                           # PIDs (755: slurmd's job steps read the socket dir)
        self.state = self.root / "state"                       # slurmctld's StateSaveLocation
        self.spool = self.root / "spool"                       # slurmd's SlurmdSpoolDir
        self.logs = self.root / "logs"
        self.bin = self.root / "bin"                           # the sacct answer from scontrol
        self.info = self.root / "cluster.json"                 # ports, node and PIDs; no secret

    @property
    def socket(self) -> Path:
        """munged's socket: in ``run/``, or (a Unix socket path has at most 107 bytes) under the system's temporary
        folder, named by this cluster's folder."""
        s = self.run / "munge.socket.2"
        if len(str(s)) < 100:
            return s
        tag = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"mergescope-munge-{tag}" / "munge.socket.2"

    def pid(self, daemon: str) -> Path:
        return self.run / f"{daemon}.pid"


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def node_resources() -> dict[str, str]:
    """This host as ``slurmd -C`` describes it (node name, CPUs, sockets, cores, threads, memory in MB)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    first = out.splitlines()[0] if out.strip() else ""
    f = dict(kv.split("=", 1) for kv in first.split() if "=" in kv)
    keys = ("NodeName", "CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    if not all(k in f for k in keys):
        raise MergescopeError(f"slurmd -C did not describe this host ({first!r}); check the slurm-wlm install ({INSTALL})")
    return {k: f[k] for k in keys}


def _user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def write_conf(lay: Layout) -> dict:
    """slurm.conf for this host (once: a later start keeps its ports); returns node name and ports."""
    info = read_info(lay)
    if lay.conf.is_file() and info.get("node"):
        return info
    node = node_resources()
    ctld_port, slurmd_port = free_port(), free_port()
    user = _user()
    lines = {
        "ClusterName": "mergescope", "SlurmctldHost": f"{node['NodeName']}({HOST})",
        "SlurmctldPort": str(ctld_port), "SlurmdPort": str(slurmd_port),
        "SlurmUser": user, "SlurmdUser": user,
        "AuthType": "auth/munge", "CredType": "cred/munge", "AuthInfo": f"socket={lay.socket}",
        "CommunicationParameters": "NoInAddrAny",
        "StateSaveLocation": str(lay.state), "SlurmdSpoolDir": str(lay.spool),
        "SlurmctldPidFile": str(lay.pid("slurmctld")), "SlurmdPidFile": str(lay.pid("slurmd")),
        "SlurmctldLogFile": str(lay.logs / "slurmctld.log"), "SlurmdLogFile": str(lay.logs / "slurmd.log"),
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none", "MpiDefault": "none",
        "SwitchType": "switch/none", "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_Core_Memory",
        "SchedulerType": "sched/backfill", "ReturnToService": "2", "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none", "JobCompType": "jobcomp/none",
        "MinJobAge": "3600", "KillWait": "10", "SlurmdTimeout": "30", "InactiveLimit": "0",
    }
    text = "# written by mergescope.cluster: a one-node cluster on this host (make cluster)\n"
    text += "".join(f"{k}={v}\n" for k, v in lines.items())
    text += (f"NodeName={node['NodeName']} NodeAddr={HOST} CPUs={node['CPUs']} Boards={node['Boards']} "
             f"SocketsPerBoard={node['SocketsPerBoard']} CoresPerSocket={node['CoresPerSocket']} "
             f"ThreadsPerCore={node['ThreadsPerCore']} RealMemory={node['RealMemory']} State=UNKNOWN\n")
    text += "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
    lay.conf.write_text(text)
    info = {"node": node["NodeName"], "cpus": int(node["CPUs"]), "mem_mb": int(node["RealMemory"]),
            "slurmctld_port": ctld_port, "slurmd_port": slurmd_port, "conf": str(lay.conf), "bin": str(lay.bin)}
    write_info(lay, info)
    return info


def _prepare(lay: Layout) -> None:
    for d in (lay.root, lay.run, lay.state, lay.spool, lay.logs, lay.bin, lay.socket.parent):
        d.mkdir(parents=True, exist_ok=True)
    for d in (lay.run, lay.socket.parent):
        os.chmod(d, 0o755)  # munge clients (sbatch, slurmstepd) must reach the socket; the key stays private
    lay.key.parent.mkdir(mode=0o700, exist_ok=True)
    os.chmod(lay.key.parent, 0o700)
    if not lay.key.is_file():
        fd = os.open(lay.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
    os.chmod(lay.key, 0o600)
    sacct = lay.bin / "sacct"
    sacct.write_text(SACCT)
    os.chmod(sacct, 0o755)


def read_info(lay: Layout) -> dict:
    try:
        return json.loads(lay.info.read_text())
    except (OSError, ValueError):
        return {}


def write_info(lay: Layout, info: dict) -> None:
    lay.info.write_text(json.dumps(info, indent=1) + "\n")


def daemon_pid(lay: Layout, daemon: str) -> int | None:
    try:
        pid = int(lay.pid(daemon).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid_alive(pid, daemon) else None


def environment(lay: Layout) -> dict[str, str]:
    """What a shell (or a test) needs to talk to this cluster: its slurm.conf, and the sacct answer first on PATH."""
    return {"SLURM_CONF": str(lay.conf), "PATH": f"{lay.bin}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(cmd: list[str], lay: Layout, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **environment(lay)})


def _log_tail(path: Path, n: int = 4) -> str:
    lines = path.read_text(errors="replace").splitlines()[-n:] if path.is_file() else []
    return " | ".join(lines) or f"(nothing in {path})"


def _wait(check, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise MergescopeError(f"{what} did not come up within {timeout:.0f} s: {_log_tail(log)}")
        time.sleep(0.25)


def _start_daemon(lay: Layout, daemon: str, cmd: list[str], log: Path) -> int:
    if daemon_pid(lay, daemon) is None:
        with open(log, "ab") as out:
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=60,
                               env={**os.environ, **environment(lay)}, start_new_session=True)
        if r.returncode != 0:
            raise MergescopeError(f"{daemon} failed to start ({r.returncode}): {_log_tail(log)}")
        _wait(lambda: daemon_pid(lay, daemon) is not None, daemon, log)
    return int(daemon_pid(lay, daemon))


def node_state(lay: Layout) -> str:
    r = _run(["sinfo", "-h", "-N", "-o", "%T"], lay)
    return r.stdout.strip().lower() if r.returncode == 0 else ""


def start(root: Path = DEFAULT_DIR) -> dict:
    """munged, slurmctld and slurmd for this host (the config and key written the first time); idempotent."""
    missing = missing_binaries()
    if missing:
        raise MergescopeError(f"SLURM or MUNGE is not installed ({', '.join(missing)} not on PATH): run {INSTALL}, "
                              "then make cluster")
    lay = Layout(Path(root).resolve())
    _prepare(lay)
    info = write_conf(lay)
    pids = {"munged": _start_daemon(lay, "munged", [
        "munged", "--force", f"--key-file={lay.key}", f"--socket={lay.socket}", f"--pid-file={lay.pid('munged')}",
        f"--log-file={lay.logs / 'munged.log'}", f"--seed-file={lay.run / 'munged.seed'}"], lay.logs / "munged.log")}
    pids["slurmctld"] = _start_daemon(lay, "slurmctld", ["slurmctld", "-f", str(lay.conf)], lay.logs / "slurmctld.out")
    pids["slurmd"] = _start_daemon(lay, "slurmd", ["slurmd", "-f", str(lay.conf), "-N", info["node"]],
                                   lay.logs / "slurmd.out")
    _wait(lambda: node_state(lay).startswith(("idle", "mixed", "allocated")), "the node", lay.logs / "slurmd.log", 90)
    info = {**info, **{f"{d}_pid": p for d, p in pids.items()}}
    write_info(lay, info)
    return info


def _job_steps() -> list[int]:
    """PIDs of slurmstepd processes on this host (a job's step keeps running while its slurmd is gone)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and pid_alive(int(p.name), "slurmstepd"):
            out.append(int(p.name))
    return out


def stop(root: Path = DEFAULT_DIR, timeout: float = 60) -> dict[str, bool]:
    """Cancel every job still queued or running, wait for their steps to end, then stop slurmd, slurmctld and
    munged by PID (any job step left after that is killed)."""
    lay = Layout(Path(root).resolve())
    if daemon_pid(lay, "slurmctld") is not None and shutil.which("scancel"):
        _run(["scancel", "--partition=debug"], lay)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = _run(["squeue", "-h", "-o", "%i"], lay)
            if r.returncode != 0 or not r.stdout.strip():
                break
            time.sleep(0.5)
    steps_before = set(_job_steps()) if daemon_pid(lay, "slurmd") is not None else set()
    stopped = {d: stop_pid(daemon_pid(lay, d), d) for d in DAEMONS}
    for pid in steps_before & set(_job_steps()):  # a step of this cluster's jobs that outlived its daemons
        stop_pid(pid, "slurmstepd", timeout=10)
    info = read_info(lay)
    if info:
        write_info(lay, {k: v for k, v in info.items() if not k.endswith("_pid")})
    return stopped


def status(root: Path = DEFAULT_DIR) -> dict:
    lay = Layout(Path(root).resolve())
    pids = {f"{d}_pid": daemon_pid(lay, d) for d in DAEMONS}
    up = all(pids.values())
    return {**pids, "node_state": node_state(lay) if up else None, "conf": str(lay.conf) if lay.conf.is_file() else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mergescope.cluster", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["start", "stop", "status", "env"])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the cluster's folder (default: <project>/.cluster)")
    a = p.parse_args(argv)
    lay = Layout(a.dir.resolve())
    try:
        if a.action == "start":
            s = start(a.dir)
            print(f"SLURM cluster up: node {s['node']} ({s['cpus']} CPUs, {s['mem_mb']} MB), partition debug; "
                  f"slurmctld pid {s['slurmctld_pid']}, slurmd pid {s['slurmd_pid']}, munged pid {s['munged_pid']}. "
                  f"Submit from a shell that ran: eval \"$(make cluster-env)\"; stop: make cluster-stop")
        elif a.action == "stop":
            print(", ".join(f"{k} {'stopped' if v else 'not running'}" for k, v in stop(a.dir).items()))
        elif a.action == "status":
            print(json.dumps(status(a.dir)))
        else:
            env = environment(lay)
            print(f"export SLURM_CONF={env['SLURM_CONF']}\nexport PATH={lay.bin}:\"$PATH\"")
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
