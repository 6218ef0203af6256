"""Where an item table is split along V (`VocabSharding`, `vocab_sharding_of`).

A traced array on a mesh with automatic axes carries no sharding: inside your
own `jax.jit` there, pass `VocabSharding(mesh, ("model",))` explicitly.
"""

import math
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding


class VocabSharding(NamedTuple):
    """The mesh and the axes dimension 0 of the table is split over."""

    mesh: object
    vocab_axes: tuple

    @property
    def num_shards(self):
        """The number of table shards."""
        return math.prod(self.mesh.shape[a] for a in self.vocab_axes)


def _from_spec(mesh, spec):
    """Returns a `VocabSharding` if `spec` splits dimension 0 over > 1 devices, else None."""
    if mesh is None or spec is None or len(spec) == 0 or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    sharding = VocabSharding(mesh, tuple(axes))
    return sharding if sharding.num_shards > 1 else None


def _keras_layout(variable):
    """Returns the Keras `TensorLayout` (or jax sharding) of a Keras variable, if any."""
    import keras

    layout = None
    distribution = keras.distribution.distribution()
    if distribution is not None:
        layout = distribution.get_variable_layout(variable)
    if layout is None:
        # Set by Keras when the variable was created under a distribution.
        layout = getattr(variable, "_layout", None)
    return layout


def vocab_sharding_of(embeddings):
    """Returns the `VocabSharding` of a table (Keras layout, `NamedSharding`, traced type), or None.

    >>> import numpy as np
    >>> vocab_sharding_of(np.zeros((10, 4), "float32")) is None
    True
    """
    import keras

    if isinstance(embeddings, keras.Variable):
        layout = _keras_layout(embeddings)
        if layout is None:
            return None
        if isinstance(layout, NamedSharding):
            return _from_spec(layout.mesh, layout.spec)
        mesh = getattr(layout, "device_mesh", None)
        if mesh is None:
            return None
        return _from_spec(mesh.backend_mesh, tuple(layout.axes))
    if isinstance(embeddings, jax.core.Tracer):
        try:
            sharding = jax.typeof(embeddings).sharding
        except Exception:  # no sharding-in-types on this jax
            return None
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or getattr(mesh, "empty", True):
            return None
        return _from_spec(mesh, getattr(sharding, "spec", None))
    sharding = getattr(embeddings, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return _from_spec(sharding.mesh, sharding.spec)
    return None
