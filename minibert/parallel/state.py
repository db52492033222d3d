"""The rank grid: which process (one per GPU) does which part of TP x DP x PP training.

A run of `world` processes is split three ways: TP ranks share the matrices of every layer (tensor
parallelism), PP ranks hold consecutive slices of the layers (pipeline stages), and DP = world / (TP x PP)
replicas of that model see different data (data parallelism). Megatron's order puts the tensor-parallel
ranks next to each other (fastest), then data-parallel, then pipeline (slowest):

    rank = tp_rank + TP * (dp_rank + DP * pp_rank)          grid = arange(world).view(PP, DP, TP)

so the chattiest group (TP talks inside every layer) is made of consecutive ranks: the GPUs of one node.
World 16, TP 2, PP 4 (so DP 2), `python -m minibert.parallel.state --world-size 16 --tp 2 --pp 4`:

                 dp 0      dp 1
    stage 0    [ 0  1]   [ 2  3]        tensor-parallel groups: one bracket      [0 1] [2 3] ...
    stage 1    [ 4  5]   [ 6  7]        data-parallel groups:   same place, other replica   [0 2] [1 3] ...
    stage 2    [ 8  9]   [10 11]        pipeline groups:        down a column     [0 4 8 12] ...
    stage 3    [12 13]   [14 15]        model-parallel groups:  one replica       [0 1 4 5 8 9 12 13] ...
                                        embedding groups:       first + last stage [0 12] [1 13] ...

The embedding group joins the first and last stage of each (dp, tp) position: with pipelining the word
embedding (first stage) and the tied LM head (last stage) are two copies whose gradients are summed.

`Launch` is what torchrun tells each process (WORLD_SIZE, RANK, LOCAL_RANK), read from the environment
in one place (Launch.from_environment). `ParallelState` holds the sizes, this rank's coordinates and its
process groups. train.setup reads the Launch once, validates the flags for its world size (which checks
TP x PP against it and derives DP), then builds the state from those sizes, and passes it to whatever
needs it: no module-level groups, no globals. A group of one process is stored as None, and every
collective here is a no-op on None, so a one-process run is simply a grid of size 1 that never
initialises torch.distributed: one code path for every world size.

What production does: Megatron's parallel_state.py keeps ~60 module-level groups (context and expert
parallelism, hierarchical groups, gloo twins for CPU objects); we keep the five BERT training needs."""
import datetime
import gc
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error

GROUP_KINDS = ("tensor", "data", "pipeline", "model", "embedding")


def check_sizes(world_size: int, tp: int, pp: int) -> int:
    """-> DP; raises UsageError naming the fix when the world does not split into TP x PP. Run once on
    sizes nobody has checked yet (validate, for the trainer's flags); what follows takes TP, DP, PP."""
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("world size", world_size)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1")
    if world_size % (tp * pp):
        raise UsageError(f"{world_size} process{'es' if world_size != 1 else ''} cannot be split into TP x PP = "
                         f"{tp} x {pp} = {tp * pp} "
                         f"model-parallel groups: launch a multiple of {tp * pp} processes or change "
                         "--tensor-model-parallel-size / --pipeline-model-parallel-size")
    return world_size // (tp * pp)


def rank_grid(tp: int, dp: int, pp: int) -> dict:
    """kind -> list of groups (lists of global ranks) of a world of TP x DP x PP, Megatron's order (see the
    module docstring)."""
    grid = torch.arange(tp * dp * pp).view(pp, dp, tp)  # grid[pp_rank, dp_rank, tp_rank] = global rank
    return {
        "tensor": [grid[p, d, :].tolist() for p in range(pp) for d in range(dp)],
        "data": [grid[p, :, t].tolist() for p in range(pp) for t in range(tp)],
        "pipeline": [grid[:, d, t].tolist() for d in range(dp) for t in range(tp)],
        "model": [grid[:, d, :].flatten().tolist() for d in range(dp)],
        "embedding": [sorted({int(grid[0, d, t]), int(grid[-1, d, t])}) for d in range(dp) for t in range(tp)],
    }


def coordinates(rank: int, tp: int, dp: int):
    """global rank -> (tp_rank, dp_rank, pp_rank), the inverse of rank = tp + TP * (dp + DP * pp)."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


@dataclass(frozen=True)
class Launch:
    """This process's place in the launch: WORLD_SIZE processes, this one's global RANK and its LOCAL_RANK
    on its node (the GPU it takes). A plain `python` run (no torchrun) is a world of one."""
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_environment(cls) -> "Launch":
        """torchrun's WORLD_SIZE / RANK / LOCAL_RANK: the one place minibert reads them (MASTER_ADDR /
        MASTER_PORT are read by init_process_group)."""
        return cls(world_size=int(os.environ.get("WORLD_SIZE", "1")), rank=int(os.environ.get("RANK", "0")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))


@dataclass
class ParallelState:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # kind -> this rank's ProcessGroup, None for a group of one
    rng: object = None  # this rank's tensor-parallel generator (minibert.parallel.rng), set by the trainer

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_rank(self) -> int:
        return coordinates(self.rank, self.tp, self.dp)[0]

    @property
    def dp_rank(self) -> int:
        return coordinates(self.rank, self.tp, self.dp)[1]

    @property
    def pp_rank(self) -> int:
        return coordinates(self.rank, self.tp, self.dp)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The last rank prints the log lines (as Megatron): it is on the last stage, which has the losses."""
        return self.rank == self.world_size - 1

    def group(self, kind: str):
        return self.groups.get(kind)

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of stage `pp_rank` at this rank's (dp, tp) position (a p2p peer)."""
        return self.tp_rank + self.tp * (self.dp_rank + self.dp * pp_rank)

    @classmethod
    def create(cls, launch: Launch, tp: int, dp: int, pp: int, backend: str = "gloo",
               timeout_minutes: float = 10.0, device=None) -> "ParallelState":
        """This rank's state for sizes already checked against the launch (validate: TP x DP x PP is its
        world size, the timeout positive): pick the device, then, with several processes, create the
        process groups. No checks here: a bad layout has exited on every rank before any collective."""
        if device is None:
            device = torch.device("cuda", launch.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        state = cls(tp=tp, pp=pp, dp=dp, rank=launch.rank, local_rank=launch.local_rank, device=torch.device(device))
        if launch.world_size > 1:
            if state.device.type == "cuda":
                torch.cuda.set_device(state.device)
            if not dist.is_initialized():
                dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                        timeout=datetime.timedelta(minutes=timeout_minutes))
            for kind, groups in rank_grid(tp, dp, pp).items():
                for ranks in groups:  # every rank creates every group, in the same order (a collective)
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if launch.rank in ranks:
                        state.groups[kind] = group
        return state

    @classmethod
    def from_environment(cls, tp: int = 1, pp: int = 1, backend: str = "gloo", timeout_minutes: float = 10.0,
                         device=None) -> "ParallelState":
        """For a script without a Config (tests/distributed, bench): the launch from the environment, its
        sizes checked here *before* any collective (so a bad layout exits on every rank instead of
        hanging), then create(). The trainer checks its flags with validate instead (train.setup)."""
        launch = Launch.from_environment()
        dp = check_sizes(launch.world_size, tp, pp)
        if timeout_minutes <= 0:
            raise UsageError(f"--distributed-timeout-minutes {timeout_minutes} must be positive (e.g. 10, or 0.1)")
        return cls.create(launch, tp, dp, pp, backend, timeout_minutes, device)

    def barrier(self):
        if self.world_size > 1:
            dist.barrier()

    def destroy(self):
        """Tear the groups down while Python is fully alive: a gloo group left to the interpreter's
        shutdown can abort the process (its worker threads outlive the objects they use)."""
        self.groups.clear()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


# ---- collectives that are no-ops over a group of one (group None) ----
def all_reduce(tensor, group, op=dist.ReduceOp.SUM, async_op=False):
    if group is None:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def describe_grid(world_size: int, tp: int, pp: int) -> str:
    """The picture of the module docstring, for any sizes, and every group listed."""
    dp = check_sizes(world_size, tp, pp)
    groups = rank_grid(tp, dp, pp)
    width = len(str(world_size - 1))
    cell = max(2 + tp * width + (tp - 1), len(f"dp {dp - 1}"))  # "[" + tp ranks + "]", or the header
    lines = [f"world {world_size} = TP {tp} x DP {dp} x PP {pp}    rank = tp_rank + {tp} * (dp_rank + {dp} * pp_rank)",
             "", " " * 9 + " ".join(f"dp {d}".center(cell) for d in range(dp)).rstrip()]
    for p in range(pp):
        cells = ["[" + " ".join(f"{r:>{width}}" for r in groups["tensor"][p * dp + d]) + "]" for d in range(dp)]
        lines.append(f"stage {p:<3}" + " ".join(c.center(cell) for c in cells).rstrip())
    lines.append("")
    for kind in GROUP_KINDS:
        listed = groups[kind] if kind != "embedding" or pp > 1 else []
        text = " ".join("[" + " ".join(map(str, g)) + "]" for g in listed) or "(none: one pipeline stage)"
        lines.append(f"{kind + '-parallel' if kind in ('tensor', 'data', 'model') else kind} groups: {text}")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv=None):
    parser = OneLineArgumentParser(description="print the rank grid of a TP x DP x PP run")
    parser.add_argument("--world-size", type=int, required=True, help="processes (GPUs) in the run")
    parser.add_argument("--tp", type=int, default=1, help="--tensor-model-parallel-size")
    parser.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size")
    args = parser.parse_args(argv)
    print(describe_grid(args.world_size, args.tp, args.pp))


if __name__ == "__main__":
    main()
