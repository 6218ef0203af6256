"""Op recording for CUDA Graph capture: which aten ops a capture cannot hold, and a tape.

`OpTape` is a `TorchDispatchMode` that records every aten op a region runs
(`names`, and `(op, args, kwargs, outputs)` in `records`) and, with
`refuse=True`, raises `CaptureRefused` at the first op a CUDA Graph capture
refuses or silently freezes (`CAPTURE_FORBIDDEN_OPS`: tensors made from host
data, host syncs, data-dependent shapes). It also remembers every pre-existing
tensor the region writes in place, so `undo()` can restore it (a CUDA capture
executes nothing). Used by `capture.RecordingCapture` (the CPU stand-in
capture) and by the runner's checked warm-up step.

Example:

>>> forbidden_ops(["mm", "item", "lift_fresh"])
['item', 'lift_fresh']
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CAPTURE_FORBIDDEN_OPS", "CaptureRefused", "OpTape", "forbidden_ops"]

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
CAPTURE_FORBIDDEN_OPS = HOST_DATA_OPS | HOST_SYNC_OPS


class CaptureRefused(RuntimeError):
    """A region did something a CUDA Graph capture cannot hold (host data or a host sync)."""


def forbidden_ops(op_names):
    """Returns the names among `op_names` (aten overload packets) that a capture refuses, sorted."""
    return sorted(set(op_names) & CAPTURE_FORBIDDEN_OPS)


class OpTape(TorchDispatchMode):
    """A TorchDispatchMode that records (op, args, kwargs, outputs) and refuses capture-breaking ops.

    Args:
        refuse: raise `CaptureRefused` at the first op of `CAPTURE_FORBIDDEN_OPS`
            and remember the tensors the region overwrites (for `undo`);
            `False` only records.
    """

    def __init__(self, refuse=True):
        super().__init__()
        self.refuse = refuse
        self.records = []
        self.names = []
        self.created = set()
        self.saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            source = args[1] if name == "copy_" else args[0]
            target = args[0].device if name == "copy_" else kwargs.get("device")
            if target is not None and source.device != torch.device(target):
                name = "_to_copy_from_host" if source.device.type == "cpu" else name
        self.names.append(name)
        if self.refuse and name in CAPTURE_FORBIDDEN_OPS:
            raise CaptureRefused(
                f"aten.{name} inside a captured region (tensor from host data or a host "
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
    """Returns the tensor arguments an aten op writes in place (its schema's mutable arguments)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written
