"""Data-parallel ERASE on `torch.distributed`: per-block gradient all-reduce in a fixed order.

How and why (and why not DDP): docs/erase.md, "torch.distributed". Collectives
are issued in the same order on every rank: block reductions in the model's
block order from the one thread that runs the block backwards, the remainder
from the main thread after it. One presence flag per weight in each buffer
makes a gradient missing on some rank count as zero there.

A weight split over the ranks (each rank holds other rows: a variable with
`split_over_ranks = True`, as `keras_cutbce.ItemEmbedding(vocab_parallel=True)`
makes) is never averaged nor broadcast: its gradient already sums every
rank's examples, so it is divided by the world size (the mean over the
global batch, as the averaged weights).
"""

import torch
import torch.distributed as dist

from keras_erase import _keras_private
from keras_erase.block_weights import block_owned_weights

__all__ = ["GradientSync", "active", "mean_over_ranks", "split_over_ranks"]


def active(group=None):
    return (
        dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    )


def mean_over_ranks(values, group=None):
    """Averages a list of floats over the ranks of `group` (one blocking all-reduce)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, group=group)
    return (tensor / dist.get_world_size(group)).tolist()


def split_over_ranks(variable):
    """Whether each rank holds its own part of `variable` (never averaged, never broadcast)."""
    return bool(getattr(variable, "split_over_ranks", False))


def _flag_dtype(dtype):
    return dtype if dtype.is_floating_point else torch.float32


class _Pending:
    """One launched all-reduce: its flat buffer, handle and the weights it covers."""

    def __init__(self, name, params, flat, work):
        self.name = name
        self.params = params
        self.flat = flat
        self.work = work
        self.all_present = False


class GradientSync:
    """Averages `EraseModel`'s gradients over a process group (default: the world): `start_step`,
    `block_done(block)` after each block's backward, `reduce_rest()` after the final one, `finish()`.
    """

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._pending = []
        self._split = []  # this step's weights split over the ranks: scaled, not reduced
        self._owned = {}
        self._owner_key = None
        self._weights = []
        self._done = set()
        self._reduced = set()  # ids of the block-owned tensors whose reduction was launched
        self._watches = []  # the checking step's gradient hooks
        self._late = []  # (block name, weight) whose gradient grew after its reduction
        # Labels of the reductions launched in the current/last step, in issue order.
        self.launch_order = []

    # -- parameters --------------------------------------------------------------

    def broadcast_parameters(self, model):
        """Copies every weight of `model` (`model.weights`) from rank 0 to all ranks, in place."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for variable in model.weights:
                if split_over_ranks(variable):
                    continue
                value = _keras_private.uncast_value(variable)
                if isinstance(value, torch.Tensor):
                    dist.broadcast(value.data, src=src, group=self.group)

    # -- one step --------------------------------------------------------------------

    def start_step(self, model):
        """Resets the step; maps each block to the weights it owns (again, and checked, when they change)."""
        self._pending = []
        self._split = []
        self._done = set()
        self.launch_order = []
        self._weights = list(model.trainable_weights)
        blocks = model.detach_blocks()
        key = (id(model), tuple(id(w) for w in self._weights), tuple(id(b) for b in blocks))
        if key != self._owner_key:
            self._owner_key = key
            self._owned = block_owned_weights(model, blocks)
            self._watch_owned(blocks)

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
        if self._watches:  # before the snapshot: a later accumulation is always seen
            self._reduced.update(id(_keras_private.uncast_value(v)) for v in weights)
        self._launch(block.name, weights)

    def _watch_owned(self, blocks):
        """Hooks every block-owned gradient for one step, to see one that grows after its reduction."""
        self._unwatch()
        for block in blocks:
            for weight in self._owned.get(id(block), []):
                param = _keras_private.uncast_value(weight)
                if not (isinstance(param, torch.Tensor) and param.requires_grad):
                    continue

                def watch(tensor, name=block.name, weight=weight):
                    if id(tensor) in self._reduced:
                        self._late.append((name, weight))

                self._watches.append(param.register_post_accumulate_grad_hook(watch))

    def _unwatch(self):
        for handle in self._watches:
            handle.remove()
        self._watches, self._reduced = [], set()

    def _check_owned(self):
        late, self._late = self._late, []
        self._unwatch()
        if late:
            self._owner_key = None
            names = ", ".join(sorted({f"{w.path!r} (DetachBlock {b!r})" for b, w in late}))
            raise RuntimeError(
                "keras_erase: under torch.distributed, the gradient of "
                f"{names} grew after its block's all-reduce was launched: the weight is also "
                "used outside the block, in a way the layer walk does not see. Call the layer "
                "only inside the block, hold it as a layer of the model too (then it is "
                "reduced after the main backward), or use dispatch='standard'."
            )

    def reduce_rest(self):
        rest = [v for v in self._weights if id(v) not in self._done]
        for v in rest:
            self._done.add(id(v))
        self._launch("remainder", rest)

    def _launch(self, name, weights):
        self._split += [v for v in weights if split_over_ranks(v)]
        weights = [v for v in weights if not split_over_ranks(v)]
        # The parameters, never autocast copies: the inline launcher calls this
        # inside the block's mixed-precision scope.
        params = [_keras_private.uncast_value(v) for v in weights]
        params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
        if not params:
            return
        self.launch_order.append(name)
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
                pending = _Pending(name, group, (flat, None), work)
            else:  # integer gradients do not exist in practice; kept for completeness
                flat, flags = torch.cat(pieces), torch.cat(flags)
                w1 = dist.all_reduce(flat, group=self.group, async_op=True)
                w2 = dist.all_reduce(flags, group=self.group, async_op=True)
                pending = _Pending(name, group, (flat, flags), (w1, w2))
            pending.all_present = all_present
            self._pending.append(pending)

    def finish(self):
        """Waits for every reduction, averages and writes the gradients back (a late gradient raises first)."""
        pending, self._pending = self._pending, []
        split, self._split = self._split, []
        cuda = torch.cuda.is_available()
        with torch.no_grad():
            for variable in split:
                grad = _keras_private.uncast_value(variable).grad
                if grad is not None:
                    grad.div_(self.world_size)
            for item in pending:
                for work in item.work if isinstance(item.work, tuple) else (item.work,):
                    work.wait()
            if self._watches:
                self._check_owned()
            for item in pending:
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
        self._pending = []
        self._split = []
        self._late = []
        if self._watches:  # the checking step failed: the next step checks again
            self._owner_key = None
        self._unwatch()
