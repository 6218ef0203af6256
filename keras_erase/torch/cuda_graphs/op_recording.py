"""What a CUDA Graph capture cannot hold, and the tapes that see it on CPU.

`OpTape` records a region's aten ops and refuses `CAPTURE_FORBIDDEN_OPS`
(tensors from host data, host syncs, data-dependent shapes); `HostReads`
sees the host reads that dispatch no aten op on CPU (`.cpu()`, `.numpy()`,
`np.asarray(t)`, `.tolist()`); `SyncRecorder` counts what would sync on CUDA.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CAPTURE_FORBIDDEN_OPS", "CaptureRefused", "HostReads", "OpTape", "SYNC_OPS", "SyncRecorder",
    "describe_op", "forbidden_ops",
]

# aten ops a CUDA Graph capture refuses or silently freezes: tensors built from host
# (Python/numpy) data, host <-> device synchronisations and data-dependent shapes.
HOST_DATA_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "scalar_tensor", "_to_copy_from_host"})
HOST_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "equal",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",
        "_assert_async",
    }
)
# Tensor methods that read a device tensor on the host and dispatch no aten op that
# says so on CPU (`.item()`, `float(t)`, `bool(t)` dispatch `_local_scalar_dense`).
# (`.to(device)` is not one: on the stand-in, Keras's device is the CPU.)
HOST_READ_FUNCTIONS = frozenset({"Tensor.cpu", "Tensor.numpy", "Tensor.__array__", "Tensor.tolist"})
CAPTURE_FORBIDDEN_OPS = HOST_DATA_OPS | HOST_SYNC_OPS | HOST_READ_FUNCTIONS
# What implies a host-device synchronisation on CUDA: host reads, data-dependent
# shapes, and tensors copied from host data (a pageable host-to-device copy
# synchronises). `scalar_tensor` is not one: on CUDA it is a fill kernel (a
# capture freezes its value, hence its place among the forbidden ops).
SYNC_OPS = CAPTURE_FORBIDDEN_OPS - {"scalar_tensor"}


class CaptureRefused(RuntimeError):
    """A region did something a CUDA Graph capture cannot hold."""


def forbidden_ops(op_names):
    return sorted(set(op_names) & CAPTURE_FORBIDDEN_OPS)


def describe_op(name):
    """Names a recorded op for a message: `"aten.item"`, or a tensor method as is."""
    return name if name.startswith("Tensor.") else f"aten.{name}"


def _op_name(func, args, kwargs):
    """An aten op's overload packet name; `_to_copy_from_host` for a host-to-device copy."""
    name = func.overloadpacket.__name__
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        if target is not None and source.device != torch.device(target):
            name = "_to_copy_from_host" if source.device.type == "cpu" else name
    return name


def _host_read(func, args, kwargs):
    name = getattr(func, "__name__", None)
    if name in ("cpu", "numpy", "__array__", "tolist"):
        return f"Tensor.{name}"
    return None


class HostReads(TorchFunctionMode):
    """Records (or, with `refuse`, refuses) the host reads of `HOST_READ_FUNCTIONS`."""

    def __init__(self, refuse=True):
        super().__init__()
        self.refuse = refuse
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _host_read(func, args, kwargs)
        if name is not None:
            self.names.append(name)
            if self.refuse:
                raise CaptureRefused(
                    f"{name} inside a captured region (a host read of a device tensor); a CUDA "
                    "Graph capture would fail here, and a replay would reuse a stale value."
                )
        return func(*args, **kwargs)


class OpTape(TorchDispatchMode):
    """Records a region's ops; `refuse`: refuses `CAPTURE_FORBIDDEN_OPS`, keeps overwrites for `undo()`."""

    def __init__(self, refuse=True):
        super().__init__()
        self.refuse = refuse
        self.records = []
        self.names = []
        self.created = set()
        self.saved = {}
        self._host_reads = _TapeHostReads(self)

    def __enter__(self):
        self._host_reads.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._host_reads.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._host_reads.__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func, args, kwargs)
        self.names.append(name)
        if self.refuse and name in CAPTURE_FORBIDDEN_OPS:
            raise CaptureRefused(
                f"{describe_op(name)} inside a captured region (tensor from host data or a host "
                "sync); a CUDA Graph capture would fail here."
            )
        if self.refuse:  # capture executes nothing: remember what this op overwrites
            for tensor in _written_args(func, args, kwargs):
                if id(tensor) not in self.created and id(tensor) not in self.saved:
                    self.saved[id(tensor)] = (tensor, tensor.detach().clone())
        out = func(*args, **kwargs)
        self.records.append((func, args, kwargs, out))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.created.add(id(t))
        return out

    def undo(self):
        """Restores every pre-existing tensor the region wrote (e.g. batch-norm statistics)."""
        with torch.no_grad():
            for tensor, value in reversed(list(self.saved.values())):
                tensor.data.copy_(value)  # `.data`: no autograd version bump


def _written_args(func, args, kwargs):
    """The tensor arguments an aten op writes in place (its schema's mutable arguments)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


class _TapeHostReads(HostReads):
    def __init__(self, tape):
        super().__init__(refuse=tape.refuse)
        self.names = tape.names


class _SyncOps(TorchDispatchMode):
    def __init__(self, names):
        super().__init__()
        self.names = names
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func, args, kwargs)
        self.ops += 1
        if name in SYNC_OPS:
            self.names.append(name)
        return func(*args, **kwargs)


class SyncRecorder:
    """Lists in `names` what would sync host and device on CUDA (`SYNC_OPS`); one per thread."""

    def __init__(self, names=None):
        self.names = [] if names is None else names
        self.ops = 0
        self._modes = []

    def __enter__(self):
        reads = HostReads(refuse=False)
        reads.names = self.names
        self._modes = [reads, _SyncOps(self.names)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)
        self.ops += self._modes[1].ops
        self._modes = []
