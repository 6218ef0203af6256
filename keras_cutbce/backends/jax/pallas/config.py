"""The static settings of one Pallas call and of one kernel pass."""

from typing import NamedTuple


class Config(NamedTuple):
    """Static (hashable) settings of one call, the same for all its passes (docs/tpu.md)."""

    vocab_size: int  # V
    coef: object  # BCE's `BCECoefficients`, or softmax's `math.Softmax`
    row_tile: int  # rows of one kernel step (a multiple of 128)
    tile: int  # items of one vocabulary tile (a multiple of 128)
    num_ids: int  # L
    mm_dtype: str  # the matmul operands' dtype
    interpret: object  # True, False, or None: decided by the compilation target
    vmem_capacity: object  # VMEM bytes per TensorCore, None: unknown
    precision: object  # `lax.Precision` of float32 matmuls (None: default)
    table_dtype: str  # dtype of the table gradient the kernels write
    dv_view: bool  # the table read as its `[D, V]` view (D % 128 != 0)
    cores: int = 1  # TensorCores the vocabulary is split across
    family: str = "bce"  # the loss family: "bce" or "softmax"
    positives: bool = True  # softmax: the kernels find the rows' ids (hit bits); False: no ids
    newton_reciprocal: bool = False  # BCE's `1 / u` as the approximate reciprocal and one Newton step

    @property
    def softmax(self):
        return self.family == "softmax"


class Pass(NamedTuple):
    """Static shape of one pass over the table for one block of resident rows."""

    has_bias: bool
    with_loss: bool  # writes the rows' loss sums (softmax: max and sum exp)
    with_grads: bool  # writes the gradients, rows weighted by `row_scale`
    carry: bool  # the table and bias gradients add to earlier blocks' (aliased)
    block_rows: int  # resident rows of this pass
    tiles_per_core: int
    counts_per_row_tile: bool  # in-tile id counts per (tile, row tile), else per tile
    positive_sums: bool = False  # softmax: writes the sums of the rows' positives' logits
