"""`run_local`: runs a function on N local torch.distributed ranks (gloo, or NCCL with a GPU per rank)."""

import datetime
import logging
import multiprocessing
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist

__all__ = ["free_port", "process_group_backend", "run_local"]

LOGGER = logging.getLogger("keras_erase")

_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "GLOO_SOCKET_IFNAME", "KERAS_BACKEND")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend(cuda_devices, nproc):
    """`("nccl", [device per rank])` with a CUDA device per rank, else `("gloo", None)`."""
    if cuda_devices >= nproc >= 1:
        return "nccl", list(range(nproc))
    return "gloo", None


def _rank_entry(fn, rank, world, args, kwargs, threads, timeout_s, results, backend, devices):
    try:
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(rank)
        torch.set_num_threads(threads)
        if devices is not None:  # one GPU per rank, before anything touches CUDA
            torch.cuda.set_device(devices[rank])
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            value = fn(rank, world, *args, **kwargs)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_local(
    fn, nproc, args=(), kwargs=None, threads_per_rank=None, timeout_s=600, backend=None
):
    """Runs `fn(rank, nproc, *args, **kwargs)` on `nproc` local ranks; returns the results.

    Each rank is a spawned process with `KERAS_BACKEND=torch` in a process group
    on the loopback address; under it `EraseModel` averages the gradients over
    the ranks, so `fn` only builds the model and trains it on its shard. `fn`
    must be importable by the spawned processes (not a lambda, not unguarded
    `__main__` code) and its result picklable.

    Args:
        fn: importable, picklable function of `(rank, world_size, *args, **kwargs)`.
        nproc: number of ranks (processes), >= 1.
        args, kwargs: extra arguments (picklable), the same for every rank.
        threads_per_rank: torch intra-op threads per rank (default: cores // nproc, >= 1).
        timeout_s: the whole run's limit in seconds, also the process group's
            collective timeout; on expiry every rank is killed.
        backend: `"gloo"`, `"nccl"` or `None`: NCCL with rank `r` on `cuda:r`
            when there is a CUDA device per rank, else gloo (logged).

    Returns:
        The list of the ranks' return values, in rank order.

    Raises:
        ValueError: `nproc` < 1, an unknown `backend`, or `"nccl"` without a
            CUDA device per rank.
        RuntimeError: a rank raised (the message carries its traceback) or died.
        TimeoutError: the ranks did not finish within `timeout_s`.

    Example:

    ```python
    def train(rank, world, x, y):  # in an importable module; returns this rank's step times
        ...
    per_rank = run_local(train, 2, args=(x, y))
    # A step ends with its slowest rank: never add per-rank percentiles.
    qps = throughput_percentiles(global_step_seconds(per_rank)[5:], batch_size=2 * 256)
    ```
    """
    nproc = int(nproc)
    if nproc < 1:
        raise ValueError(f"run_local: `nproc` must be >= 1. Received: nproc={nproc}")
    kwargs = dict(kwargs or {})
    threads = int(threads_per_rank or max(1, (os.cpu_count() or 1) // nproc))
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen, devices = process_group_backend(cuda_devices, nproc)
    if backend is not None and backend != chosen:
        if backend == "nccl":
            if cuda_devices < nproc:
                raise ValueError(
                    "run_local: backend='nccl' needs one CUDA device per rank. "
                    f"Received: backend='nccl', nproc={nproc} with {cuda_devices} CUDA devices"
                )
            devices = list(range(nproc))
        elif backend == "gloo":
            devices = None
        else:
            raise ValueError(
                f"run_local: `backend` must be 'gloo', 'nccl' or None. Received: backend={backend!r}"
            )
        chosen = backend
    LOGGER.info(
        "keras_erase.torch.launch: %d ranks on backend %r%s", nproc, chosen,
        "" if devices is None else f" (rank r on cuda:r, devices {devices})",
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "GLOO_SOCKET_IFNAME": "lo",
        "KERAS_BACKEND": "torch",
    }
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(env)  # inherited by the spawned ranks
    procs = []
    try:
        for rank in range(nproc):
            p = context.Process(
                target=_rank_entry,
                args=(fn, rank, nproc, tuple(args), kwargs, threads, timeout_s, results,
                      chosen, devices),
                name=f"keras_erase-rank{rank}",
            )
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs, errors = {}, {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(outputs) + len(errors) < nproc:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"run_local: {nproc} ranks did not finish in {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"run_local: rank process {dead[0].name} died "
                        f"(exit code {dead[0].exitcode})"
                    ) from None
                continue
            (outputs if ok else errors)[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=0 if errors or len(outputs) < nproc else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"run_local: rank {rank} failed:\n{errors[rank]}")
    return [outputs[r] for r in range(nproc)]
