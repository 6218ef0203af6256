"""Data-parallel ERASE on `torch.distributed`: per-block gradient all-reduce in a fixed order.

When a `torch.distributed` process group is initialized (gloo on CPU, NCCL on
CUDA) with more than one rank, `EraseModel`'s torch train step keeps the ranks
in sync with a `GradientSync`:

1. At the start of training (the first train step of every `fit`, and the
   first train step ever) every model weight (`model.weights`: trainable and
   non-trainable, e.g. batch-norm statistics; not the random seed states, so
   dropout masks differ between ranks) is broadcast from rank 0, so all ranks
   start from rank 0's weights. Optimizer state is not broadcast:
   ranks start from the same optimizer state (fresh, or the same checkpoint)
   and it then evolves identically because the averaged gradients are.
2. During the step, as soon as a `DetachBlock`'s early backward ends, the
   gradients of that block's weights are flattened into one buffer per
   (dtype, device), and an asynchronous SUM all-reduce (`async_op=True`) is
   launched on it, while the forward pass of later blocks goes on.
3. After the final (main) backward, the gradients of every other trainable
   weight (the "remainder": layers outside blocks, and weights shared by
   several blocks) are all-reduced the same way.
4. Before the optimizer update every handle is waited, each buffer is divided
   by the world size and copied back into the `.grad` of its weights. The
   optimizer then applies the rank-averaged gradients, identically everywhere.

Why this is correct with several backward calls per step: a block's input and
output are detached, so its weights receive gradient only from its own local
loss, through its own `torch.autograd.backward` call (as long as the block's
layers are not also called outside it). When that call returns (and the block
is not called again in the step, which is checked), the
block's `.grad` are final for the step and can be reduced at once, whatever
the other backward calls do later. The remainder's gradients come from the
final backward (the main loss and, with `detach_input=False`, the input
gradients the blocks handed over: `keras_erase.torch.handoff`); they are reduced
only after it ended. DDP is not used: its reducer hooks fire on every backward and
assume one backward per step per iteration (`find_unused_parameters` and
`no_sync` do not express "this parameter's gradient is final after *that*
backward"), and its buckets follow parameter registration order, not the
order in which ERASE finishes blocks.

Collective order: gloo and NCCL match collectives by issue order, so every
rank must issue them in the same order. Block reductions are issued right
after each block's backward by the dispatcher, in the order blocks run, which
is the model's fixed forward order on every rank: `"blocking"` and
`"streams"` issue them from the main thread, `"threaded"` from its single FIFO
worker (which runs the blocks' backwards in submission order). The remainder
is issued from the main thread only after the worker queue drained, so two
threads never issue collectives concurrently and the order never depends on
thread timing. With `dispatch="auto"` the ranks average their step timings
(one all-reduce) before choosing, so all ranks pick the same schedule.

Each buffer carries one presence flag per weight (made on the device, no tensor
from host data): a weight whose gradient is `None` on some rank counts as zero
there, and stays `None` only if it is `None` on every rank (Keras optimizers
skip `None` gradients). Only a rank that lacks some gradient reads the flags
back (one host read in `finish`); launching a block's reduction never syncs.

The `"standard"` dispatch under a process group runs one forward and one
backward, then all-reduces every trainable gradient the same way.

Logged losses and metrics are per rank (each rank's own shard); average them
yourself (e.g. `torch.distributed.all_reduce`) if you need global values.

Example (one process per rank, e.g. under `torchrun`):

```python
import torch.distributed as dist
dist.init_process_group("gloo")  # "nccl" on CUDA
model = build_model()            # an EraseModel with DetachBlocks
model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
model.fit(x_shard, y_shard)      # this rank's shard; gradients are averaged
```
"""

import torch
import torch.distributed as dist

__all__ = ["GradientSync", "active", "mean_over_ranks"]


def active(group=None):
    """Returns whether a `torch.distributed` process group of more than one rank is initialized."""
    return (
        dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    )


def mean_over_ranks(values, group=None):
    """Averages a list of floats over the ranks of `group` (one blocking all-reduce).

    Example: `mean_over_ranks([0.12, 0.10])` on 2 ranks -> the per-entry averages.
    """
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, group=group)
    return (tensor / dist.get_world_size(group)).tolist()


def _flag_dtype(dtype):
    return dtype if dtype.is_floating_point else torch.float32


class _Pending:
    """One launched all-reduce: its flat buffer, handle and the weights it covers."""

    def __init__(self, label, params, flat, work):
        self.label = label
        self.params = params
        self.flat = flat
        self.work = work
        self.all_present = False


class GradientSync:
    """Averages `EraseModel` gradients over a `torch.distributed` process group.

    Used by `EraseModel`'s torch train step (see the module docstring); user
    code only needs to initialize the process group.

    Args:
        group: the process group (default: the world group).

    Example:

    ```python
    sync = GradientSync()
    sync.start_step(model)
    # ... forward; after block b's backward: sync.block_done(b) ...
    sync.reduce_rest()   # after the final backward
    sync.finish()        # waits, averages and writes the .grad back
    ```
    """

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._pending = []
        self._owned = {}
        self._weights = []
        self._done = set()
        # Labels of the reductions launched in the current/last step, in issue order.
        self.launch_order = []

    # -- parameters --------------------------------------------------------------

    def broadcast_parameters(self, model):
        """Copies every weight of `model` (`model.weights`) from rank 0 to all ranks, in place."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for variable in model.weights:
                value = variable.value
                if isinstance(value, torch.Tensor):
                    dist.broadcast(value.data, src=src, group=self.group)

    # -- one step --------------------------------------------------------------------

    def start_step(self, model):
        """Resets the step state and maps each block to the weights it alone owns."""
        self._pending = []
        self._done = set()
        self.launch_order = []
        self._weights = list(model.trainable_weights)
        counts = {}
        blocks = model.detach_blocks()
        per_block = {id(b): list(b.trainable_weights) for b in blocks}
        for weights in per_block.values():
            for v in {id(w): w for w in weights}.values():
                counts[id(v)] = counts.get(id(v), 0) + 1
        # A weight shared by several blocks is final only after all of them: remainder.
        self._owned = {
            key: [v for v in weights if counts[id(v)] == 1] for key, weights in per_block.items()
        }

    def block_done(self, block):
        """Launches the all-reduce of `block`'s gradients (its backward has just ended)."""
        key = id(block)
        if key in self._done:
            raise RuntimeError(
                f"keras_erase: DetachBlock {block.name!r} ran twice in one training step under "
                "torch.distributed; its gradients were already being reduced. Call each "
                "DetachBlock once per step (or use dispatch='standard')."
            )
        self._done.add(key)
        weights = self._owned.get(key, [])
        for v in weights:
            self._done.add(id(v))
        self._launch(block.name, weights)

    def reduce_rest(self):
        """Launches the all-reduce of every trainable gradient not reduced yet this step."""
        rest = [v for v in self._weights if id(v) not in self._done]
        for v in rest:
            self._done.add(id(v))
        self._launch("remainder", rest)

    def _launch(self, label, weights):
        params = [v.value for v in weights]
        params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
        if not params:
            return
        self.launch_order.append(label)
        buckets = {}
        for p in params:
            buckets.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), group in buckets.items():
            pieces = [
                (p.grad.detach().reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=device))
                for p in group
            ]
            flag_dtype = _flag_dtype(dtype)
            # Presence flags made on the device (fills, no tensor from host data: no
            # host-to-device copy and no sync per block, which would end the overlap).
            flags = [
                (torch.zeros if p.grad is None else torch.ones)(1, dtype=flag_dtype, device=device)
                for p in group
            ]
            all_present = all(p.grad is not None for p in group)
            if flag_dtype == dtype:
                flat = torch.cat(pieces + flags)
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                pending = _Pending(label, group, (flat, None), work)
            else:  # integer gradients do not exist in practice; kept for completeness
                flat, flags = torch.cat(pieces), torch.cat(flags)
                w1 = dist.all_reduce(flat, group=self.group, async_op=True)
                w2 = dist.all_reduce(flags, group=self.group, async_op=True)
                pending = _Pending(label, group, (flat, flags), (w1, w2))
            pending.all_present = all_present
            self._pending.append(pending)

    def finish(self):
        """Waits for every reduction, averages, and writes the gradients back."""
        pending, self._pending = self._pending, []
        cuda = torch.cuda.is_available()
        with torch.no_grad():
            for item in pending:
                works = item.work if isinstance(item.work, tuple) else (item.work,)
                for work in works:
                    work.wait()
                flat, flags = item.flat
                if cuda and flat.is_cuda:
                    flat.record_stream(torch.cuda.current_stream(flat.device))
                n = sum(p.numel() for p in item.params)
                if item.all_present:  # every weight had a gradient here: no need to read flags
                    present = [1.0] * len(item.params)
                else:  # one host read, only on a rank that lacks some gradient
                    present = (flat[n:] if flags is None else flags).tolist()
                values = flat[:n].div_(self.world_size)
                offset = 0
                for p, seen in zip(item.params, present):
                    size = p.numel()
                    if seen > 0:
                        piece = values[offset : offset + size].view_as(p)
                        if p.grad is None:
                            p.grad = piece.clone()
                        else:
                            p.grad.copy_(piece)
                    offset += size

    def abort(self):
        """Drops the step's pending reductions without waiting (the step failed)."""
        self._pending = []
