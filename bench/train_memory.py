"""minibert/train.py with the CUDA caching allocator's account printed at exit: peak allocated and reserved
memory, how often an allocation failed and was retried after freeing the cache (each retry waits for the
GPU and returns every cached block to the driver), and out-of-memory errors. For runs at the memory edge.

    python bench/train_memory.py [--memory-cap-gib N] TRAIN.PY-FLAGS...

--memory-cap-gib caps what this process may allocate (torch.cuda.set_per_process_memory_fraction), so a
larger GPU can stand in for a smaller one."""
import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report():
    stats = torch.cuda.memory_stats()
    print(f"allocator: peak allocated {stats['allocated_bytes.all.peak'] / 2**30:.2f} GiB, peak reserved "
          f"{stats['reserved_bytes.all.peak'] / 2**30:.2f} GiB, allocation retries {stats['num_alloc_retries']}, "
          f"out-of-memory errors {stats['num_ooms']}, blocks returned to the driver {stats['num_device_free']}",
          flush=True)


def main(argv):
    if argv[:1] == ["--memory-cap-gib"]:
        cap, argv = float(argv[1]) * 2**30, argv[2:]
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    import atexit
    atexit.register(report)
    script = os.path.join(ROOT, "minibert", "train.py")
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    main(sys.argv[1:])
