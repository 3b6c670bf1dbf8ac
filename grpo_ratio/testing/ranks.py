"""Multi-process runs on CPU (gloo) that end: the rank side (`end_rank`) and the launching side (`run_ranks`). For
tests and benchmarks only (never imported by the library).

Why a rank hung after training (tests/test_distributed.py, 2 of 2 runs on a loaded 2-core machine): the last owner of
a gloo process group was the DDP `Reducer` of a trainer still alive after `destroy_process_group()`; when it was
freed, `~ProcessGroupGloo` joined the gloo worker threads while holding the GIL, and a worker thread was still freeing
its last finished collective (the final barrier, holding the gather before it), whose tensors need the GIL to be
freed: a deadlock (pytorch/pytorch#56297: pybind classes whose destructor can block; the Python `ProcessGroup`
objects release the GIL before destruction, the `Reducer` does not). On an idle machine the worker thread is done
before the main thread gets there; under load it is not. `end_rank` frees every DDP model while the group is still
registered (so the Reducer's reference is not the last), then destroys the group through the objects that release
the GIL.

`accelerate launch` (torch elastic) starts each rank in a session of its own, so killing the launcher leaves the
ranks running; `run_ranks` tags every process it starts with a launch id in the environment and, after the run (and
on a timeout), kills every process that carries it, wherever it was re-parented.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence


LAUNCH_ID_ENV = "GRPO_RATIO_LAUNCH_ID"


def end_rank() -> None:
    """End this rank's gloo process group so that the process exits: a barrier (every rank is done with every
    collective), then every unreachable DDP model freed while the group is still registered, then
    `torch.distributed.destroy_process_group()`. Call it last, after dropping every reference to the trainers (and
    models) this rank built, e.g. at module level after `main()` returned.

    Raises:
        RuntimeError: a `DistributedDataParallel` model is still referenced (its Reducer would be the group's last
            owner and could deadlock at exit); the message says what to drop.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()  # trainers in reference cycles free their DDP model here, while the group is still registered
    alive = sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects())
    if alive:
        raise RuntimeError(f"end_rank: {alive} DistributedDataParallel model(s) still referenced; drop every trainer "
                           "and model (del, or return from the function that built them) before end_rank(), else the "
                           "gloo group is freed by the DDP Reducer holding the GIL and the rank can hang at exit")
    dist.destroy_process_group()


def processes_of(launch_id: str) -> list[int]:
    """Pids of the live processes (zombies excluded) whose environment carries `GRPO_RATIO_LAUNCH_ID=launch_id`, read
    from /proc (Linux); [] where /proc cannot be read."""
    tag = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def kill_launch(launch_id: str, grace_s: float = 5.0) -> list[int]:
    """SIGKILL every process of the launch (and the process group each leads), until none is left or `grace_s`
    passed; returns the pids that were alive at the first look."""
    first = processes_of(launch_id)
    deadline = time.monotonic() + grace_s
    pids = first
    while pids and time.monotonic() < deadline:
        for pid in pids:
            for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                try:
                    kill(pid)
                except OSError:  # not a group leader, or already gone
                    pass
        time.sleep(0.1)
        pids = processes_of(launch_id)
    return first


def run_ranks(cmds: Sequence[Sequence[str]], timeout: float, envs: Sequence[dict] | None = None,
              cwd: str | os.PathLike | None = None) -> list[subprocess.CompletedProcess]:
    """Run the commands side by side (one `accelerate launch`, or one command per rank), each in a new session, with
    a wall-clock limit for all of them together, and leave no process behind.

    `envs`: one environment per command (default: this process's); each gets `GRPO_RATIO_LAUNCH_ID`, inherited by
    everything the command starts. On a timeout every process of the launch is killed (their process groups, the
    ranks that `accelerate launch` put in sessions of their own included) and `subprocess.TimeoutExpired` is raised
    with the output so far. After the commands ended, a process of the launch still alive is killed and reported.

    Returns:
        one `CompletedProcess` per command (stdout and stderr as text).
    Raises:
        subprocess.TimeoutExpired: the commands ran past `timeout` seconds (everything was killed).
        RuntimeError: a process of the launch was still alive after its command ended (it was killed).
    """
    launch_id = uuid.uuid4().hex
    envs = list(envs) if envs is not None else [dict(os.environ) for _ in cmds]
    if len(envs) != len(cmds):
        raise ValueError(f"run_ranks: {len(cmds)} commands but {len(envs)} environments")
    # output to files, not pipes: a process left behind keeps a pipe open, and reading to its end would wait for it
    with tempfile.TemporaryDirectory() as tmp:
        files = [(open(os.path.join(tmp, f"{i}.out"), "w+"), open(os.path.join(tmp, f"{i}.err"), "w+"))
                 for i in range(len(cmds))]
        procs = []
        try:
            for cmd, env, (out, err) in zip(cmds, envs, files, strict=True):
                procs.append(subprocess.Popen(list(cmd), env={**env, LAUNCH_ID_ENV: launch_id}, cwd=cwd, stdout=out,
                                              stderr=err, start_new_session=True))
            deadline = time.monotonic() + timeout
            try:
                for proc in procs:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired as expired:
                killed = kill_launch(launch_id)
                for proc in procs:
                    proc.kill()
                    proc.wait()
                out, err = (_read(f) for f in files[0])
                raise subprocess.TimeoutExpired(expired.cmd, timeout, output=out, stderr=err) from RuntimeError(
                    f"run_ranks: past {timeout} s; killed {len(killed)} process(es) of the launch: {killed}")
            left = kill_launch(launch_id)
            outputs = [(_read(out), _read(err)) for out, err in files]
        except BaseException:  # an interrupt or an error here: the ranks in their own sessions die too
            kill_launch(launch_id)
            raise
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for out, err in files:
                out.close()
                err.close()
    if left:
        raise RuntimeError(f"run_ranks: {len(left)} process(es) of the launch outlived it and were killed: {left}; "
                           f"last stderr: {outputs[0][1][-2000:]}")
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, errs)
            for proc, (out, errs) in zip(procs, outputs, strict=True)]


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()
