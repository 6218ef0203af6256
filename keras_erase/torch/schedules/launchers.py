"""Who launches a block's backward: `InlineLauncher` (main thread) or `WorkerLauncher` (a worker).

A launcher takes the block's backward as a job (a closure that enters the
block's stream and runs `torch.autograd.backward`) right after the block's
forward pass:

- `InlineLauncher` (`launcher="inline"`): runs it at once on the main thread.
  On CUDA, `torch.autograd.backward` returns only when autograd's device
  thread has launched every backward kernel, so the next block's forward is
  enqueued after this block's whole backward.
- `WorkerLauncher` (`launcher="worker"`): submits it to one FIFO
  `BackwardWorker` thread and returns; the main thread goes on with the next
  forward pass while the worker launches the backward (in submission order).

`wait()` blocks until every job of the step ran (re-raising the first error);
`close()` ends the worker thread.

Example:

>>> launcher = InlineLauncher()
>>> ran = []
>>> launcher.launch(lambda: ran.append(1)); launcher.wait(); ran
[1]
"""

from keras_erase.torch.schedules.worker import BackwardWorker

__all__ = ["InlineLauncher", "WorkerLauncher", "make_launcher"]


class InlineLauncher:
    """Runs each backward job at once, on the calling (main) thread."""

    name = "inline"
    worker = None

    def launch(self, job):
        job()

    def wait(self):
        """Nothing to wait for: every job already ran."""

    def close(self):
        """Nothing to release."""


class WorkerLauncher:
    """Submits each backward job to one FIFO `BackwardWorker` thread.

    Args:
        threads: torch intra-op threads of the worker thread (`None`: left alone).
    """

    name = "worker"

    def __init__(self, threads=None):
        self.worker = BackwardWorker(threads=threads)

    def launch(self, job):
        self.worker.submit(job)

    def wait(self):
        self.worker.wait()

    def close(self):
        self.worker.stop()


def make_launcher(name, threads=None):
    """Builds the launcher `name` names (`"inline"` or `"worker"`)."""
    if name == "inline":
        return InlineLauncher()
    if name == "worker":
        return WorkerLauncher(threads=threads)
    raise ValueError(f"`launcher` must be 'inline' or 'worker'. Received: launcher={name!r}")
