"""Helpers for tests that run minibert/train.py as a user does: one process, or real `torchrun` processes
(gloo on CPU, one thread each), each launch with a free port and a timeout so a hang fails in seconds.
Results are read back from the console lines and the TensorBoard files the runs write."""
import os
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, "minibert", "train.py")
TIMEOUT = 240  # seconds for one launch: the slowest (8 processes on 2 cores) takes ~60
# A test that every rank prints its own error line gives torchrun this long between checks of its
# workers: at torchrun's 0.1 s the first rank to exit had the other stopped before it printed (seen
# under load, 2026-12-02, in the layout-error tests and in test_faults' exception test), and at 5 s
# once too (2026-12-03, a second pytest sharing the 2 cores); each rank still exits at once, the
# interval only delays torchrun's teardown.
EVERY_RANK_SPEAKS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(name, None)
    return e


def torchrun_command(nproc, args, nnodes=1, node_rank=0, port=None, monitor_interval=None):
    """monitor_interval: seconds between torchrun's checks of its workers (its default, 0.1 s, stops the
    survivors of a dead worker at once: a test of what the survivors say themselves gives them longer)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(port or free_port())]
    if monitor_interval is not None:
        launcher += ["--monitor-interval", str(monitor_interval)]
    if nnodes > 1:
        launcher += ["--nnodes", str(nnodes), "--node_rank", str(node_rank)]
    return launcher + [TRAIN_PY] + [str(a) for a in args]


def run(nproc, args, timeout=TIMEOUT, monitor_interval=None):
    """nproc == 1: `python minibert/train.py ARGS`; else `torchrun --nproc_per_node N minibert/train.py ARGS`
    (monitor_interval: as torchrun_command's)."""
    command = ([sys.executable, TRAIN_PY] + [str(a) for a in args] if nproc == 1
               else torchrun_command(nproc, args, monitor_interval=monitor_interval))
    return subprocess.run(command, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=timeout)


def run_nodes(nnodes, nproc_per_node, args, timeout=TIMEOUT):
    """`nnodes` torchrun launchers on this machine, as if on separate nodes (--nnodes, --node_rank)."""
    port = free_port()
    procs = [subprocess.Popen(torchrun_command(nproc_per_node, args, nnodes, r, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT) for r in range(nnodes)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


class Job:
    """A launch (`command`, as torchrun_command builds it) in its own process group, its output read while
    it runs, so that a test acts when a line appears instead of after a guessed sleep (which, on a loaded
    machine, lands before the run has started or after it has ended)."""

    def __init__(self, command):
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                        cwd=ROOT, start_new_session=True)
        self.out, self.err = [], []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, lines):
        for line in stream:
            with self.changed:
                lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, accept, timeout=TIMEOUT):
        """The first stdout line for which accept(line) is true (waiting for it); fails if the job ends first."""
        deadline, checked = time.monotonic() + timeout, 0
        with self.changed:
            while True:
                for line in self.out[checked:]:
                    if accept(line):
                        return line
                checked = len(self.out)
                assert self.readers[0].is_alive(), "the job ended before the line came:\n" + "".join(self.err)[-3000:]
                assert time.monotonic() < deadline, "no such line in time:\n" + "".join(self.out)[-2000:]
                self.changed.wait(timeout=1.0)

    def finish(self, timeout=TIMEOUT):
        """Wait for the end -> (returncode, stdout, stderr)."""
        self.process.wait(timeout=timeout)
        for reader in self.readers:
            reader.join()
        return self.process.returncode, "".join(self.out), "".join(self.err)


def tensorboard_scalars(directory) -> dict:
    """tag -> [(step, value), ...] from the event files a run wrote (float32, as TensorBoard stores them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def comparable_lines(stdout):
    """The log and validation lines with the timing fields removed (what two exact runs share)."""
    timing = re.compile(r"elapsed time per iteration \(ms\): [\d.]+ \| ")
    return [timing.sub("", line) for line in stdout.splitlines() if line.startswith(("iteration ", "validation loss"))]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def run_main(main, argv, capsys):
    """A command's main(argv) in this process (no interpreter start-up) -> (exit code, stdout, stderr), for
    the checks of what a command refuses; each command keeps a test that starts it as a user does."""
    import pytest
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def usage_error(args, world_size) -> str:
    """The message of the UsageError that the trainer's checks raise for `args` on `world_size` processes
    (in this process: every rank runs the same checks before any collective, and prints this message as
    one `error:` line; tests/test_data_parallel.py shows it through torchrun)."""
    from minibert.config import parse_args
    from minibert.errors import UsageError
    from minibert.validate import validate
    try:
        validate(parse_args([str(a) for a in args]), world_size=world_size, warn=None)
    except UsageError as e:
        return str(e)
    raise AssertionError(f"no error for {args} on {world_size} processes")


def assert_close_runs(reference, other, tags=("lm loss", "sop loss", "lm acc", "sop acc", "grad-norm"), rel=1e-5):
    """Every logged value of `tags` equal within `rel` (relative); returns the worst relative difference.
    The accuracies are counts of argmax hits: equal layouts count the same hits, so they match exactly
    (unless a layout's rounding flips a near-tie of two logits)."""
    worst = 0.0
    for tag in tags:
        ref, got = reference[tag], other[tag]
        assert [s for s, _ in ref] == [s for s, _ in got], tag
        for (step, a), (_, b) in zip(ref, got):
            difference = abs(a - b) / max(abs(a), 1e-12)
            assert difference <= rel, f"{tag} at iteration {step}: {a} vs {b} (relative {difference:.2e})"
            worst = max(worst, difference)
    return worst


RUNS = {}  # launches shared between tests of a session: name -> (CompletedProcess, TensorBoard scalars)


def layout_run(data, tmp_path_factory, name, nproc, *extra):
    """The layout configuration (tests/conftest.py layout_args) with `extra` flags on `nproc` processes,
    run once per session and shared by the tests that name it."""
    from tests.conftest import layout_args
    if name not in RUNS:
        tb = tmp_path_factory.mktemp(name) / "tb"
        result = run(nproc, layout_args(data, tb, *extra))
        assert result.returncode == 0, result.stderr[-3000:]
        RUNS[name] = (result, tensorboard_scalars(tb))
    return RUNS[name]
