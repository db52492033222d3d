"""--profile: where a training step's time goes, as the torch profiler sees it.

Timing a whole step says how long it took, not why. The profiler records every operator the step runs
on the host and, on a GPU, every kernel on the device, with their durations. Profiling a couple of
steady-state iterations (not the first, which pays for allocations and Triton compilation) and sorting
the operators by their own time shows which ones to make faster; the trace file shows them on a
timeline, with the gaps where the GPU waited for the host."""
import os

import torch


class Profiler:
    """--profile: torch.profiler over iterations [--profile-step-start, --profile-step-end) (Megatron's
    flags, counted from 0 like its loop), written as a Chrome trace (chrome://tracing, Perfetto, or
    TensorBoard's profiler tab) per rank, and its top 15 operations by device time printed by the
    logging rank: where the step's time goes."""

    def __init__(self, cfg, state):
        self.cfg, self.state, self.active = cfg, state, None

    def at(self, iteration, end=False):
        cfg = self.cfg
        if not cfg.profile:
            return
        if self.active is None and not end and iteration == cfg.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.state.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities)
            self.active.__enter__()
        elif self.active is not None and (end or iteration == cfg.profile_step_end):
            if self.state.device.type == "cuda":
                torch.cuda.synchronize()
            self.active.__exit__(None, None, None)
            directory = cfg.tensorboard_dir or "profile"
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"profile_rank{self.state.rank}_iter{cfg.profile_step_start}.json")
            self.active.export_chrome_trace(path)
            if self.state.is_logging_rank:
                key = "self_cuda_time_total" if self.state.device.type == "cuda" else "self_cpu_time_total"
                print(self.active.key_averages().table(sort_by=key, row_limit=15), flush=True)
                print(f"profile of iterations [{cfg.profile_step_start}, {iteration}) written to {path}", flush=True)
            self.active = None
