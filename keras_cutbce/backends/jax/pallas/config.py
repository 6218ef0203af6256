"""The static settings of one Pallas call and of one kernel pass."""

from typing import NamedTuple



class Config(NamedTuple):
    """Static (hashable) settings of one call, the same for all its passes.

    Attributes:
        vocab_size: `V`.
        coef: BCE's weights (`keras_cutbce.math.coefficients`); for softmax,
            `math.Softmax` (its label smoothing).
        row_tile: rows of one kernel step (a multiple of 128).
        tile: items of one vocabulary tile (a multiple of 128).
        num_ids: `L`, target ids per row.
        mm_dtype: dtype name of the matmul operands.
        interpret: True, False, or None: decided by the compilation target.
        vmem_capacity: the target's VMEM bytes per TensorCore, or None: unknown.
        precision: `lax.Precision` of float32 matmuls (None: the default).
        table_dtype: dtype name of the table gradient the kernels write.
        dv_view: the kernels read the table as its `[D, V]` view (D % 128 != 0).
        cores: TensorCores of the target chip (the vocabulary is split across them).
        family: the loss family, `"bce"` or `"softmax"` (`kernel`).
    """

    vocab_size: int
    coef: object
    row_tile: int
    tile: int
    num_ids: int
    mm_dtype: str
    interpret: object
    vmem_capacity: object
    precision: object
    table_dtype: str
    dv_view: bool
    cores: int = 1
    family: str = "bce"

    @property
    def softmax(self):
        return self.family == "softmax"


class Pass(NamedTuple):
    """Static shape of one kernel pass over the table for one block of resident rows.

    Attributes:
        has_bias: the call has a bias.
        with_loss: the pass writes the rows' loss sums.
        with_grads: the pass writes the hidden, table and bias gradients
            (rows weighted by `row_scale`).
        carry: the table and bias gradients add to those of earlier row
            blocks (aliased inputs).
        block_rows: resident rows of this pass (a multiple of the row tile).
        tiles_per_core: vocabulary tiles a TensorCore visits (the last core may idle).
        counts_per_row_tile: in-tile id counts per (vocabulary tile, row
            tile), else per vocabulary tile.
    """

    has_bias: bool
    with_loss: bool
    with_grads: bool
    carry: bool
    block_rows: int
    tiles_per_core: int
    counts_per_row_tile: bool
