"""When something goes wrong in a run of many processes: no silent hang, one line saying what happened.

Three cases, and what each rank does:

    a rank raises an exception     it records "rank R failed: <error>" in torchrun's key-value store,
                                   prints its traceback once (each line prefixed [rank R]) and exits 1
    a rank dies (killed, OOM)      the others' next collective fails (gloo: the connection drops; NCCL: its
    or hangs                       watchdog) or times out after --distributed-timeout-minutes; each of them
                                   then prints one line naming the failed rank: from the store's record, or
                                   the rank whose process is gone (ranks register their host and pid at start)
    SIGTERM / SIGINT with          the signal only sets a flag; after each iteration the ranks agree (one
    --exit-signal-handler          all-reduce over a gloo group with a short timeout) and all save a
                                   checkpoint and exit 0 together; if a rank is gone the agreement fails and
                                   they exit 1 without saving, leaving the last complete checkpoint

torchrun forwards SIGTERM to its workers and kills them 30 s later, so a save on SIGTERM must finish within
that; SLURM sends SIGTERM before its own kill too (its grace period is set by --signal / KillWait).

What production does: Megatron's --exit-signal-handler gathers the flags with an all-gather every iteration,
and NVIDIA's fault-tolerance package restarts ranks in place; we stop cleanly and let a resume continue."""
import datetime
import os
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from minibert.errors import print_error_line

PREFIX = "minibert/"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()  # torchrun's rendezvous store
    except Exception:
        return None


def register(state):
    """Every rank writes where it runs, so a survivor can tell which process is gone."""
    store = _store() if state.world_size > 1 else None
    if store is not None:
        store.set(f"{PREFIX}rank/{state.rank}", f"{socket.gethostname()} {os.getpid()}")


def _gone_ranks(state):
    """Ranks on this host whose process no longer exists."""
    store, gone = _store(), []
    if store is None:
        return gone
    host = socket.gethostname()
    for rank in range(state.world_size):
        try:
            where = store.get(f"{PREFIX}rank/{rank}").decode()
        except Exception:
            continue
        rank_host, pid = where.rsplit(" ", 1)
        if rank_host == host and not _alive(int(pid)):
            gone.append(rank)
    return gone


def _alive(pid) -> bool:
    """The process exists and is not a zombie (a killed worker stays one until torchrun reaps it). Also
    what minibert/training/save_lock.py asks before taking over a lock left by a run of this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _recorded_failure():
    store = _store()
    if store is None:
        return None
    try:
        store.set_timeout(datetime.timedelta(seconds=1)) if hasattr(store, "set_timeout") else None
        if store.check([f"{PREFIX}failed"]):
            return store.get(f"{PREFIX}failed").decode()
    except Exception:
        return None
    return None


def record(state, error):
    """A user error on this rank: tell the others what stopped the run (they may be waiting on it)."""
    store = _store() if state.world_size > 1 else None
    if store is not None:
        try:
            store.set(f"{PREFIX}failed", f"rank {state.rank}: {' '.join(str(error).split())[:300]}")
        except Exception:
            pass


def looks_like_communication(error) -> bool:
    text = f"{type(error).__name__} {error}"
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "NCCL", "Connection", "connection", "Timed out", "timed out",
                                  "Broken pipe", "closed by peer", "ProcessGroup"))


def handle(state, error, timeout_minutes):
    """A rank's exception in a run of several processes: report it as the module docstring says, exit 1."""
    rank = state.rank
    failure = _recorded_failure()
    if failure is None and looks_like_communication(error):
        gone = _gone_ranks(state)
        for _ in range(10):  # a killed rank's sockets close while it exits, a moment before it is a zombie
            if gone:
                break
            time.sleep(0.1)
            gone = _gone_ranks(state)
        failure = (f"rank {', '.join(map(str, gone))} is gone (killed or crashed)" if gone else
                   f"a collective failed or waited longer than --distributed-timeout-minutes {timeout_minutes:g} "
                   f"(a rank on another node stopped or hangs; look at its output): {str(error).splitlines()[0][:200]}")
    if failure is not None:
        print_error_line(f"error: [rank {rank}] stopping: {failure}")
    else:  # this rank's own error: record it for the others, then show it once
        store = _store()
        if store is not None:
            try:
                store.set(f"{PREFIX}failed", f"rank {rank} failed: {type(error).__name__}: "
                                             f"{str(error).splitlines()[0][:300] if str(error) else ''}")
            except Exception:
                pass
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # no teardown of process groups whose peers are gone (it can hang)


class SignalFlag:
    """--exit-signal-handler: SIGTERM and SIGINT set a flag (a second SIGINT interrupts at once)."""

    def __init__(self, state, timeout_minutes):
        self.state, self.received = state, None
        self.group = None
        if state.world_size > 1:  # a CPU group with a short timeout, for the agreement only
            seconds = min(60.0, timeout_minutes * 60.0)
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Did any rank receive a signal? The same answer on every rank (one tiny all-reduce)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
