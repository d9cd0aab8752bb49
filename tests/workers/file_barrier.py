"""A barrier through files, for the moments of a multi-process test when Horovod's own collectives
are down (between hvd.shutdown() and hvd.init(), or with a rank's data plane held on purpose)."""
import os
import time


def file_barrier(directory: str, name: str, rank: int, size: int, timeout: float = 60.0) -> None:
    """Returns once every rank of `size` has called it with this `name` in `directory`."""
    open(os.path.join(directory, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, f"{name}.{r}")) for r in range(size)):
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank}: not every rank reached {name} within {timeout:.0f} s")
        time.sleep(0.01)
