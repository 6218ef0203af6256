"""`BackwardWorker`: the FIFO worker thread that launches block backward passes."""

import queue
import threading
import weakref

import torch

__all__ = ["NAME", "BackwardWorker"]

NAME = "keras_erase-backward"


def _serve(jobs, errors, settings):
    """The worker thread's loop (a function, so the thread never keeps its worker alive)."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            threads = settings.get("threads")
            if threads is not None and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)  # this thread's OpenMP team only
            if not errors:  # after an error, the rest of the step is skipped
                job()
        except BaseException as error:  # noqa: BLE001 - re-raised by wait()
            errors.append(error)
        finally:
            job = None  # drop the closure (it may reference the `ScheduleRun`)
            jobs.task_done()


def _stop_thread(jobs, thread, join):
    if thread.is_alive():
        jobs.put(None)
        if join and thread is not threading.current_thread():
            thread.join(timeout=5)


class BackwardWorker:
    """One daemon thread running jobs in order; `wait()` re-raises an error, which skips the step's rest.

    The thread ends with `stop()` or when the worker is garbage-collected; the
    next `submit` starts another. `threads`: its intra-op count, set in the
    thread itself before every job (OpenMP teams are per thread).
    """

    def __init__(self, threads=None, name=NAME):
        self.name = name
        self._jobs = queue.Queue()
        self._errors = []
        self._settings = {"threads": None if threads is None else int(threads)}
        self._thread = None
        self._finalizer = None
        self._lock = threading.Lock()

    @property
    def threads(self):
        return self._settings["threads"]

    @threads.setter
    def threads(self, value):
        self._settings["threads"] = None if value is None else int(value)

    @property
    def alive(self):
        return self._thread is not None and self._thread.is_alive()

    def _ensure_alive(self):
        with self._lock:
            if not self.alive:
                thread = threading.Thread(
                    target=_serve,
                    args=(self._jobs, self._errors, self._settings),
                    name=self.name,
                    daemon=True,
                )
                thread.start()
                self._thread = thread
                self._finalizer = weakref.finalize(self, _stop_thread, self._jobs, thread, False)

    def submit(self, job):
        self._ensure_alive()
        self._jobs.put(job)

    def wait(self):
        """Blocks until every submitted job ran; re-raises the first error."""
        if self._jobs.unfinished_tasks and not self.alive:
            self._ensure_alive()  # never wait on a dead worker
        self._jobs.join()
        errors = list(self._errors)
        self._errors.clear()
        if errors:
            raise errors[0]

    def stop(self):
        with self._lock:
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            if self._thread is not None:
                _stop_thread(self._jobs, self._thread, True)
            self._thread = None


