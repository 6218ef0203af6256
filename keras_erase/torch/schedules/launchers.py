"""Who launches a block's backward: `InlineLauncher` (the main thread) or `WorkerLauncher` (a worker).

With the worker the main thread goes on with the next forward at once.
"""

from keras_erase.torch.schedules.worker import BackwardWorker

__all__ = ["InlineLauncher", "WorkerLauncher", "make_launcher"]


class InlineLauncher:
    name = "inline"
    worker = None

    def launch(self, job):
        job()

    def wait(self):
        pass

    def close(self):
        pass


class WorkerLauncher:
    """Submits each backward job to one `BackwardWorker` (`threads`: its intra-op threads)."""

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
    if name == "inline":
        return InlineLauncher()
    if name == "worker":
        return WorkerLauncher(threads=threads)
    raise ValueError(f"`launcher` must be 'inline' or 'worker'. Received: launcher={name!r}")
