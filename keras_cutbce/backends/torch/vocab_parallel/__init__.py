"""A table split along V over torch.distributed ranks: the layout, the collectives, the losses, retrieval, the lookup."""

from keras_cutbce.backends.torch.vocab_parallel.checkpoint import gather_table
from keras_cutbce.backends.torch.vocab_parallel.layout import VocabLayout
from keras_cutbce.backends.torch.vocab_parallel.layout import layout_for
from keras_cutbce.backends.torch.vocab_parallel.lookup import item_logits
from keras_cutbce.backends.torch.vocab_parallel.lookup import lookup
from keras_cutbce.backends.torch.vocab_parallel.loss import cut_bce
from keras_cutbce.backends.torch.vocab_parallel.loss import cut_softmax
from keras_cutbce.backends.torch.vocab_parallel.metric_sums import snapshot
from keras_cutbce.backends.torch.vocab_parallel.metric_sums import sum_updates
from keras_cutbce.backends.torch.vocab_parallel.retrieval import count_above
from keras_cutbce.backends.torch.vocab_parallel.retrieval import top_k

__all__ = ["VocabLayout", "count_above", "cut_bce", "cut_softmax", "gather_table", "item_logits", "layout_for",
           "lookup", "snapshot", "sum_updates", "top_k"]
