"""Run by tests/test_faults.py under torchrun: minibert/train.py with one injected fault, an exception on
global rank 1 at its third training step (the test is of how the *other* ranks and the failing one
report it; nothing else is changed)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minibert import train  # noqa: E402

real_step, calls = train.train_step, []


def faulty_step(*args, **kwargs):
    calls.append(1)
    if os.environ.get("RANK") == "1" and len(calls) == 3:
        raise RuntimeError("injected fault on rank 1")
    return real_step(*args, **kwargs)


train.train_step = faulty_step
train.main(sys.argv[1:])
