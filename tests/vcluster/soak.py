"""A fault soak on the virtual cluster: jobs of every workload under random faults, each job restarted by Slurm.

Each trial submits one 4-node job (``sbatch --requeue``, one rank per node, accl with a short deadline) running a
workload: all-reduces, the resumable training example checkpointing every few steps, rehearsal-buffer traffic
or chunkstore gathers.  Once it runs, one fault hits: a rank killed, a node killed (link cut, every process
gone), a node's ranks stopped (SIGSTOP), or a node's link cut while everything in it lives; the checkpoint
workload is hit while a checkpoint is being written.  The soak then checks what a cluster's user relies on:
every rank process is gone within the deadline (no hang: a rank left past ``deadline + HANG_MARGIN_S`` is a
hang, its stacks dumped with py-spy), the fault is undone as an operator would (node rebooted, link back, the
stopped processes resumed), the job is requeued and finishes, and the training resumes from the newest
checkpoint finished before the fault, ending bitwise equal to an uninterrupted run.

    make cluster-up NODES=4 && python tests/vcluster/soak.py --minutes 9 --json docs/data/fault-soak.json

(``make fault-soak`` does both.)  It prints a table per fault kind; the exit status is 1 on any hang, lost
checkpoint, unfinished job or differing parameters.

Then ``--spare-trials`` trials of a job with a spare node (``torchhpc jobscript --nodes 2 --spare-nodes 1``, the
2-node training): a step node killed or its link cut after the second checkpoint; the job's supervisor must
restart the step on the spare at once (no requeue), resume from the newest finished checkpoint and end bitwise
equal to an uninterrupted run; its own table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _vcluster import (  # noqa: E402
    RANK_ENV,
    ROOT,
    VCLUSTER,
    Cluster,
    restart_trial,
    state_dir,
    uninterrupted_digest,
)

FAULTS = ("kill-rank", "kill-node", "stop-node", "cut-link")
WORKLOADS = ("allreduce", "checkpoint", "rehearsal", "chunkstore")
NODES = ("node1", "node2", "node3", "node4")
DEADLINE_S = 6.0  # accl's (and each workload's) deadline on its peers
# past the deadline, a rank still alive this much later is a hang: the barrier at exit waits one more deadline,
# then MPI_Abort gets accl's abort grace (10 s, kAbortGraceS in csrc/accl.hpp) to end the job
HANG_MARGIN_S = 30.0
FINISH_S = 240.0  # the requeued job's bound: Slurm noticing the node, the requeue's delay, the rest of the run
STEPS = {"allreduce": 300, "rehearsal": 150, "chunkstore": 150}
TRAIN_STEPS, TRAIN_EVERY = 120, 5
FAILURE = ROOT / "tests" / "vcluster" / "node_failure.py"
TRAIN = ROOT / "examples" / "resumable_training.py"
FINAL = re.compile(r"FINAL step \d+ sha256 ([0-9a-f]{64})")  # the training's digest of its final parameters


@dataclass
class Trial:
    """One job and one fault, and what came of it."""

    workload: str
    fault: str
    victim: str
    during: str = ""  # what the ranks were doing when the fault hit
    ranks_gone_s: float | None = None  # fault -> no rank process left (None: a hang)
    raised: int = 0  # ranks that printed torchhpc's error (the all-reduce, rehearsal and chunkstore workloads)
    restarts: int = 0
    finished: bool = False
    bitwise_equal: bool | None = None  # the checkpoint workload: final parameters against the uninterrupted run
    newest_at_fault: int = 0  # the newest finished checkpoint's step when the fault hit
    resumed_at: int | None = None
    lost: int = 0  # 1 when the run resumed from an older checkpoint than the newest finished one
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.ranks_gone_s is not None and self.finished and self.lost == 0
                and self.bitwise_equal is not False)


def rank_pids(script: Path) -> dict[int, str]:
    """The job's rank processes (a python running ``script``) on every node: pid -> node."""
    found = {}
    for node in NODES:
        pids = subprocess.run(["ip", "netns", "pids", f"torchhpc-{node}"], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if state != "Z" and Path(argv[0].decode()).name.startswith("python") and str(script).encode() in argv:
                found[int(pid)] = node
    return found


def stacks(pid: int) -> str:
    """Every thread's stack of ``pid``: py-spy's Python and native frames, else gdb's (a process past Python's
    finalization, e.g. inside MPI_Abort, has no interpreter left for py-spy)."""
    spy = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--native", "--pid", str(pid)],
                         capture_output=True, text=True, timeout=60)
    if spy.returncode == 0 or shutil.which("gdb") is None:
        return spy.stdout + spy.stderr
    gdb = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"], capture_output=True,
                         text=True, timeout=60)
    return gdb.stdout


def vcluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(VCLUSTER), *args], capture_output=True, text=True, timeout=120)


class Soak:
    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster, self.work, self.log = cluster, work, work / "soak.log"
        self.reference: str | None = None

    def say(self, text: str) -> None:
        print(text, flush=True)
        with self.log.open("a") as f:
            f.write(text + "\n")

    def command(self, workload: str, tag: str) -> tuple[str, Path]:
        """The rank's command line of ``workload`` and the script it runs."""
        if workload == "checkpoint":
            return (f"python {TRAIN} --dir {self.work / tag / 'ckpt'} --steps {TRAIN_STEPS} --every {TRAIN_EVERY} "
                    f"--width 256 --backend accl --timeout {DEADLINE_S}", TRAIN)
        return f"python {FAILURE} {DEADLINE_S} --workload {workload} --steps {STEPS[workload]}", FAILURE

    def submit(self, workload: str, tag: str) -> tuple[str, Path, Path]:
        """The job as a user writes one that survives faults: requeue-able, every rank ended when one fails
        (srun -K), and requeued by its own script when the step fails on a node that lives.  Returns the job's
        id, its output file and the script its ranks run."""
        cmd, ranks_run = self.command(workload, tag)
        (self.work / tag).mkdir(parents=True)
        script, out = self.work / tag / "job.sh", self.work / tag / "job.out"
        script.write_text("#!/bin/bash\n"
                          'echo "START restart=${SLURM_RESTART_COUNT:-0}"\n'
                          f"srun --mpi=pmix -K1 {cmd} && exit 0\n"
                          '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ] && scontrol requeue "$SLURM_JOB_ID"\n'
                          "exit 1\n")
        job = self.cluster.ok(f"sbatch --parsable --requeue --open-mode=append -N 4 --ntasks-per-node=1 -O "
                              f"-o {out} {script}", env=RANK_ENV).strip().splitlines()[-1]
        return job, out, ranks_run

    def uninterrupted(self) -> str:
        """The training's final digest when nothing fails (the reference for bitwise equality)."""
        cmd, _ = self.command("checkpoint", "reference")
        (self.work / "reference").mkdir(parents=True)
        out = self.cluster.ok(f"srun --mpi=pmix -N 4 --ntasks-per-node=1 -O {cmd}", timeout=300, env=RANK_ENV)
        return FINAL.findall(out)[-1]

    def wait_running(self, trial: Trial, out: Path, ckpt: Path) -> None:
        """Until the workload is in full swing; the checkpoint workload until a checkpoint is being written
        (after the first finished one, so that there is one to resume from)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if trial.workload == "checkpoint":
                if (ckpt / f"step-{TRAIN_EVERY:08d}").is_dir() and any(ckpt.glob("*.partial")):
                    trial.during = "checkpoint write"
                    return
                time.sleep(0.002)
                continue
            if out.exists() and out.read_text().count("LOOPING") == 4:
                time.sleep(random.uniform(0.0, 1.0))
                trial.during = trial.workload
                return
            time.sleep(0.1)
        raise RuntimeError(f"the {trial.workload} job never got going:\n{out.read_text() if out.exists() else ''}")

    def inject(self, trial: Trial, script: Path) -> None:
        if trial.fault == "kill-rank":
            pids = [p for p, n in rank_pids(script).items() if n == trial.victim]
            if not pids:
                raise RuntimeError(f"no rank on {trial.victim} to kill")
            os.kill(pids[0], 9)
            return
        args = {"kill-node": ["kill-node", trial.victim], "cut-link": ["cut-link", trial.victim],
                "stop-node": ["signal-node", trial.victim, "STOP", script.name]}[trial.fault]
        done = vcluster(*args)
        if done.returncode != 0:
            raise RuntimeError(f"vcluster {' '.join(args)}: {done.stderr}")

    def undo(self, trial: Trial, script: Path) -> None:
        """What the operator does: reboot the node, bring the link back, resume the stopped processes."""
        if trial.fault == "kill-node":
            done = vcluster("revive-node", trial.victim)
            if done.returncode != 0:
                raise RuntimeError(f"revive-node {trial.victim}: {done.stderr}")
        elif trial.fault == "cut-link":
            vcluster("restore-link", trial.victim)
        elif trial.fault == "stop-node":
            vcluster("signal-node", trial.victim, "CONT", script.name)  # none left once srun -K killed them

    def wait_ranks_gone(self, trial: Trial, script: Path, fault_at: float) -> None:
        """Every rank process ends within the deadline (plus the margin); what is left then is a hang."""
        while left := rank_pids(script):
            if time.monotonic() - fault_at > DEADLINE_S + HANG_MARGIN_S:
                for pid, node in left.items():
                    trial.notes.append(f"hang: pid {pid} on {node}")
                    self.say(f"HANG pid {pid} on {node}:\n{stacks(pid)}")
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                return
            time.sleep(0.2)
        trial.ranks_gone_s = round(time.monotonic() - fault_at, 1)

    def wait_finished(self, trial: Trial, job: str, out: Path) -> str:
        """Until the job has ended (the requeued run finished, or failed); returns its whole output."""
        deadline = time.monotonic() + FINISH_S
        state = ""
        while time.monotonic() < deadline:
            state = self.cluster.ok(f"scontrol show job {job} | grep -o 'JobState=[A-Z_]*' || true").strip()
            if state in ("JobState=COMPLETED", "JobState=FAILED", "JobState=CANCELLED", "JobState=TIMEOUT"):
                break
            time.sleep(1)
        text = out.read_text() if out.exists() else ""
        trial.restarts = max((int(r) for r in re.findall(r"START restart=(\d+)", text)), default=0)
        trial.finished = state == "JobState=COMPLETED"
        if not trial.finished:
            trial.notes.append(f"job ended {state or 'unknown'}")
            self.cluster.run(f"scancel {job}")
            self.say(f"UNFINISHED {state}:\n{text[-4000:]}")
        return text

    def check_training(self, trial: Trial, text: str) -> None:
        resumed = [int(s) for s in re.findall(r"RESUMED at step (\d+)", text)]
        trial.resumed_at = resumed[-1] if resumed else None
        if trial.finished and (trial.resumed_at or 0) < trial.newest_at_fault:
            trial.lost = 1
        digest = FINAL.findall(text)
        trial.bitwise_equal = bool(digest) and digest[-1] == self.reference

    def run(self, trial: Trial, index: int) -> Trial:
        start = time.monotonic()
        tag = f"t{index:03d}-{trial.workload}-{trial.fault}"
        job, out, script = self.submit(trial.workload, tag)
        ckpt = self.work / tag / "ckpt"
        try:
            self.wait_running(trial, out, ckpt)
            self.inject(trial, script)
            fault_at = time.monotonic()
            if trial.workload == "checkpoint":
                trial.newest_at_fault = max((int(p.name[5:]) for p in ckpt.glob("step-*")
                                             if not p.name.endswith(".partial")), default=0)
            self.wait_ranks_gone(trial, script, fault_at)
        finally:
            self.undo(trial, script)
        text = self.wait_finished(trial, job, out)
        trial.raised = len(re.findall(r"SURVIVOR .*family=torchhpc", text))
        if trial.workload == "checkpoint":
            self.check_training(trial, text)
        trial.seconds = round(time.monotonic() - start, 1)
        return trial


def plan(n: int, rng: random.Random, workloads: tuple[str, ...] = WORKLOADS,
         faults: tuple[str, ...] = FAULTS) -> list[tuple[str, str, str]]:
    """``n`` (workload, fault, victim): every fault with every workload once per round, in random order; the
    victim any node for a killed rank, else a node other than node1 (the login and controller node)."""
    pairs = [(w, f) for w in workloads for f in faults]
    out: list[tuple[str, str, str]] = []
    while len(out) < n:
        rng.shuffle(pairs)
        out += [(w, f, rng.choice(NODES if f == "kill-rank" else NODES[1:])) for w, f in pairs]
    return out[:n]


def table(trials: list[Trial]) -> str:
    """The soak's figures per fault kind, as a markdown table."""
    rows = ["| fault | trials | workloads hit (all_reduce / checkpoint write / rehearsal / chunkstore) | "
            "every rank gone after (median, max s) | hangs | requeued and finished | bitwise equal | "
            "checkpoints lost |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for fault in (*FAULTS, "all"):
        ts = [t for t in trials if fault in ("all", t.fault)]
        if not ts:
            continue
        gone = sorted(t.ranks_gone_s for t in ts if t.ranks_gone_s is not None)
        hit = " / ".join(str(sum(t.workload == w for t in ts)) for w in WORKLOADS)
        trained = [t for t in ts if t.workload == "checkpoint"]
        spread = f"{gone[len(gone) // 2]:.1f}, {gone[-1]:.1f}" if gone else "-"
        rows.append(f"| {fault} | {len(ts)} | {hit} | {spread} | {sum(t.ranks_gone_s is None for t in ts)} | "
                    f"{sum(t.finished and t.restarts >= 1 for t in ts)} of {len(ts)} | "
                    f"{sum(t.bitwise_equal is True for t in trained)} of {len(trained)} | "
                    f"{sum(t.lost for t in ts)} |")
    return "\n".join(rows)


SPARE_FAULTS = ("kill-node", "cut-link")


def spare_trials(cluster: Cluster, n: int) -> list[dict]:
    """``n`` spare-node trials, the faults in turn: each restart_trial's figures, or its failure as a note."""
    reference = uninterrupted_digest(cluster)
    out = []
    for i in range(n):
        fault = SPARE_FAULTS[i % len(SPARE_FAULTS)]
        try:
            t = restart_trial(cluster, "in-place", f"soak-spare-{i}", fault=fault)
        except AssertionError as exc:  # no resumed step within its bound: a hang or a failed restart
            out.append({"fault": fault, "failed": str(exc)[:2000]})
            continue
        t.update(bitwise=t["digest"] == reference, in_place="restarting in place without them" in t["log"], log=None)
        out.append(t)
        print(f"spare trial {i}: {fault} on {t['victim']}: resumed at step {t['resumed_at']} (newest "
              f"{t['newest_at_fault']}) after {t['recovery_s']:.1f} s, {t['state']}, bitwise {t['bitwise']}",
              flush=True)
        time.sleep(5)  # the revived node back in service
    return out


def spare_table(trials: list[dict]) -> str:
    """The spare-node trials per fault kind, as a markdown table."""
    rows = ["| fault (spare node) | trials | resumed in place after (median, max s) | hangs or failed restarts | "
            "completed without requeue | bitwise equal | checkpoints lost |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for fault in (*SPARE_FAULTS, "all"):
        ts = [t for t in trials if fault in ("all", t["fault"])]
        done = [t for t in ts if "failed" not in t]
        secs = [t["recovery_s"] for t in done]
        spread = f"{statistics.median(secs):.1f}, {max(secs):.1f}" if secs else "-"
        completed = sum(t["state"] == "COMPLETED" and t["in_place"] for t in done)
        rows.append(f"| {fault} | {len(ts)} | {spread} | {len(ts) - len(done)} | {completed} of {len(ts)} | "
                    f"{sum(t['bitwise'] for t in done)} of {len(ts)} | "
                    f"{sum(t['resumed_at'] < t['newest_at_fault'] for t in done)} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=9.0, help="start no trial after this (the run stays bounded)")
    p.add_argument("--trials", type=int, default=64, help="at most this many trials")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every trial and the table here")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="a comma-separated subset of the default")
    p.add_argument("--faults", default=",".join(FAULTS), help="a comma-separated subset of the default")
    p.add_argument("--spare-trials", type=int, default=4, help="then this many spare-node trials (0: none)")
    args = p.parse_args()
    workloads, faults = tuple(args.workloads.split(",")), tuple(args.faults.split(","))
    for name, given, known in (("--workloads", workloads, WORKLOADS), ("--faults", faults, FAULTS)):
        if not given or not set(given) <= set(known):
            p.error(f"{name} must be a comma-separated subset of {','.join(known)}, got {','.join(given)!r}")
    state = state_dir()
    if not (state / "nodes.list").exists() or len((state / "nodes.list").read_text().split()) != 4:
        p.error("needs the 4-node Slurm virtual cluster up: make cluster-up NODES=4")
    cluster = Cluster(state, "slurm")
    work = cluster.shared / "soak"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    soak = Soak(cluster, work)
    rng = random.Random(args.seed)
    random.seed(args.seed)
    began = time.monotonic()
    soak.reference = soak.uninterrupted() if "checkpoint" in workloads else None
    trials: list[Trial] = []
    for i, (workload, fault, victim) in enumerate(plan(args.trials, rng, workloads, faults)):
        if time.monotonic() - began > 60 * args.minutes:
            break
        trial = soak.run(Trial(workload, fault, victim), i)
        trials.append(trial)
        soak.say(f"trial {i}: {workload} / {fault} on {victim} during {trial.during}: ranks gone after "
                 f"{trial.ranks_gone_s}s, {trial.raised} raised, restarts {trial.restarts}, finished "
                 f"{trial.finished}, resumed at {trial.resumed_at} (newest {trial.newest_at_fault}), bitwise "
                 f"{trial.bitwise_equal}, {trial.seconds}s {'; '.join(trial.notes)}")
    text = table(trials)
    soak.say(f"\n{len(trials)} trials in {(time.monotonic() - began) / 60:.1f} min (seed {args.seed}, deadline "
             f"{DEADLINE_S:.0f} s)\n\n{text}")
    spare = spare_trials(cluster, args.spare_trials)
    spare_text = spare_table(spare)
    soak.say(f"\n{len(spare)} spare-node trials\n\n{spare_text}")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "deadline_s": DEADLINE_S, "table": text,
                                         "trials": [asdict(t) for t in trials], "spare_table": spare_text,
                                         "spare_trials": spare}, indent=1) + "\n")
    spare_ok = all("failed" not in t and t["bitwise"] and t["state"] == "COMPLETED" and t["in_place"] and
                   t["resumed_at"] >= t["newest_at_fault"] for t in spare)
    return 0 if all(t.ok for t in trials) and spare_ok else 1


if __name__ == "__main__":
    sys.exit(main())
