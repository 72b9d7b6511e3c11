"""Start ``nproc`` ranks of one script as plain processes, with a rendezvous that cannot collide.

No TCP port anywhere: the ranks find each other through file stores in a fresh directory
(``ENGINE_TEST_RENDEZVOUS``; :func:`rendezvous` names one store per group), so two launches on one
machine, or a port another process holds, can never meet.  All ranks share one process group of
their own; each writes its output to ``rank<r>.log``.  A launch past its timeout is first asked for
every thread's stack (``SIGUSR1``, which :func:`install_stack_dump` hooks in the rank), then killed
whole, so a stall says where each rank was and leaves no rank behind holding CPU or ports.

    ranks = run_ranks([python, script, ...], 4, env, workdir, timeout=600)
    ranks.stalled, ranks.returncodes, ranks.tail(2)
"""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import time
from dataclasses import dataclass

RENDEZVOUS_ENV = "ENGINE_TEST_RENDEZVOUS"


def rendezvous(name: str) -> str:
    """Inside a rank: the ``file://`` init method of the group ``name`` of this launch."""
    return "file://" + os.path.join(os.environ[RENDEZVOUS_ENV], name)


def install_stack_dump() -> None:
    """Inside a rank: ``SIGUSR1`` writes every thread's stack to stderr (the rank's log)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


@dataclass
class Ranks:
    """What a launch left: each rank's exit code (``None``: killed at the timeout) and log path."""
    returncodes: list
    logs: list
    stalled: bool
    seconds: float

    def tail(self, rank: int, chars: int = 4000) -> str:
        try:
            with open(self.logs[rank], errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"<no log: {e}>"


def run_ranks(argv: list, nproc: int, env: dict, workdir: str, timeout: float) -> Ranks:
    os.makedirs(workdir, exist_ok=True)
    rdzv = os.path.join(workdir, "rendezvous")
    os.makedirs(rdzv, exist_ok=True)
    logs = [os.path.join(workdir, f"rank{r}.log") for r in range(nproc)]
    procs: list = []
    t0 = time.monotonic()
    try:
        for r in range(nproc):
            renv = {**env, "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(nproc), RENDEZVOUS_ENV: rdzv}
            with open(logs[r], "w") as log:
                # rank 0 leads a new process group; the others join it: one killpg reaches all
                group = {"process_group": procs[0].pid if procs else 0}
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=renv, **group))
        stalled = not _wait_all(procs, t0 + timeout)
        if stalled:
            _signal_group(procs[0].pid, signal.SIGUSR1)     # stacks into the logs, then the end
            time.sleep(3)
    finally:
        if procs:
            _signal_group(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    codes = [None if stalled and p.returncode == -signal.SIGKILL else p.returncode for p in procs]
    return Ranks(codes, logs, stalled, round(time.monotonic() - t0, 1))


def _wait_all(procs: list, deadline: float, grace: float = 60.0) -> bool:
    """Every rank ended by ``deadline``; a rank that failed (nonzero exit) leaves its peers ``grace``
    seconds more (they would wait for it in a collective until the deadline otherwise)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return True
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
