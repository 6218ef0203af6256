"""Criteo-shaped CTR data: 13 dense features, 26 hashed categorical features.

Both sources return a dict of numpy arrays `{"dense": [n, 13] float32,
"sparse": [n, 26] int32, "label": [n, 1] float32}`. Categorical values are
hashed into `buckets` ids per feature and offset by `feature * buckets`, so
one embedding table of `26 * buckets` rows serves every feature; bucket 0
of each feature is reserved for missing values.

Example:

```python
train = synthetic_ctr(20_000, seed=0)
train["dense"].shape, train["sparse"].shape, train["label"].mean()
```
"""

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
LABEL, DENSE, SPARSE = "label", "dense", "sparse"


def _offsets(buckets):
    return (np.arange(NUM_SPARSE) * buckets).astype(np.int32)


def synthetic_ctr(
    num_examples,
    *,
    buckets=1000,
    target_ctr=0.1,
    teacher_seed=1234,
    seed=0,
):
    """Examples labelled by a fixed hidden teacher with feature interactions.

    Categorical values follow a Zipf law per feature; dense features are
    log-normal counts (log1p-transformed, as for Criteo). The teacher (the
    same for every `seed`, fixed by `teacher_seed`) scores each example with
    a linear term, pairwise dot products of 4-d latent vectors of the
    categorical values (a factorization machine), a product of two dense
    features and a non-linear term; its bias is set so the mean click
    probability is `target_ctr`. Labels are Bernoulli draws.

    Args:
        num_examples: number of examples.
        buckets: hashed ids per categorical feature.
        target_ctr: mean label (realistic CTRs are 0.03 to 0.25).
        teacher_seed: seed of the teacher's weights.
        seed: seed of the examples and labels.

    Returns:
        dict with `"dense"`, `"sparse"`, `"label"` (see the module docstring).
    """
    teacher = np.random.default_rng(teacher_seed)
    w_dense = teacher.normal(0, 0.4, NUM_DENSE)
    w_sparse = teacher.normal(0, 0.5, (NUM_SPARSE, buckets))
    latent = teacher.normal(0, 0.35, (NUM_SPARSE, buckets, 4))
    pairs = teacher.choice(NUM_SPARSE, size=(12, 2))
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, buckets)
    zipf = ranks ** -1.05
    zipf /= zipf.sum()
    sparse = 1 + rng.choice(buckets - 1, size=(num_examples, NUM_SPARSE), p=zipf)
    sparse = sparse.astype(np.int32)
    dense = np.log1p(rng.lognormal(1.0, 1.2, (num_examples, NUM_DENSE))).astype(np.float32)
    dense_std = (dense - dense.mean(0)) / (dense.std(0) + 1e-6)

    rows = np.arange(NUM_SPARSE)[None, :]
    logit = dense_std @ w_dense + w_sparse[rows, sparse].sum(axis=1)
    for a, b in pairs:
        logit += 1.5 * (latent[a, sparse[:, a]] * latent[b, sparse[:, b]]).sum(axis=1)
    logit += 0.8 * dense_std[:, 0] * dense_std[:, 1]
    logit += 0.8 * np.tanh(dense_std[:, 2] * latent[3, sparse[:, 3], 0] * 3.0)

    low, high = -20.0, 20.0  # bisection on the bias for the target CTR
    for _ in range(60):
        bias = (low + high) / 2
        if (1 / (1 + np.exp(-(logit + bias)))).mean() > target_ctr:
            high = bias
        else:
            low = bias
    probability = 1 / (1 + np.exp(-(logit + bias)))
    label = (rng.random(num_examples) < probability).astype(np.float32)[:, None]
    return {
        DENSE: dense,
        SPARSE: sparse + _offsets(buckets)[None, :],
        LABEL: label,
    }


def load_criteo(path_or_dir, *, buckets=1000, max_rows=None):
    """Criteo TSV: label, 13 integer columns, 26 hex categorical columns.

    Missing values are allowed anywhere except the label: a missing integer
    becomes 0, a missing categorical value gets bucket 0. Integers are
    transformed with `log1p(max(x, 0))`; categorical strings are hashed
    (`pandas.util.hash_array`, deterministic) into `buckets - 1` ids.

    Args:
        path_or_dir: a TSV file, or a folder whose `*.txt`/`*.tsv` files
            (e.g. `train.txt` of Criteo Display Advertising) are read.
        buckets: hashed ids per categorical feature.
        max_rows: read at most this many rows.

    Returns:
        dict with `"dense"`, `"sparse"`, `"label"`.
    """
    import glob
    import os

    import pandas as pd

    if os.path.isdir(path_or_dir):
        files = sorted(
            glob.glob(os.path.join(path_or_dir, "*.txt"))
            + glob.glob(os.path.join(path_or_dir, "*.tsv"))
        )
        if not files:
            raise FileNotFoundError(f"No .txt or .tsv Criteo file in {path_or_dir!r}.")
    else:
        files = [path_or_dir]
    names = ["label"] + [f"I{i}" for i in range(NUM_DENSE)] + [f"C{i}" for i in range(NUM_SPARSE)]
    dtypes = {"label": "float32", **{f"I{i}": "float64" for i in range(NUM_DENSE)},
              **{f"C{i}": "string" for i in range(NUM_SPARSE)}}
    frames, remaining = [], max_rows
    for path in files:
        frame = pd.read_csv(path, sep="\t", header=None, names=names, dtype=dtypes,
                            nrows=remaining, keep_default_na=False, na_values={
                                **{f"I{i}": [""] for i in range(NUM_DENSE)}})
        frames.append(frame)
        if remaining is not None:
            remaining -= len(frame)
            if remaining <= 0:
                break
    frame = pd.concat(frames, ignore_index=True)
    if frame["label"].isna().any():
        raise ValueError("Criteo rows need a label (0 or 1) in the first column.")
    dense = frame[[f"I{i}" for i in range(NUM_DENSE)]].to_numpy(np.float64)
    dense = np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0)).astype(np.float32)
    sparse = np.zeros((len(frame), NUM_SPARSE), np.int32)
    for i in range(NUM_SPARSE):
        values = frame[f"C{i}"].fillna("").to_numpy(dtype=object)
        hashed = pd.util.hash_array(values.astype(str), categorize=True)
        ids = 1 + (hashed % np.uint64(buckets - 1)).astype(np.int64)
        sparse[:, i] = np.where(values == "", 0, ids)
    return {
        DENSE: dense,
        SPARSE: sparse + _offsets(buckets)[None, :],
        LABEL: frame["label"].to_numpy(np.float32)[:, None],
    }


def split(data, test_fraction=0.2):
    """Splits a data dict into `(train, test)` (the last examples are the test set)."""
    n = len(data[LABEL])
    cut = n - max(1, int(n * test_fraction))
    return ({k: v[:cut] for k, v in data.items()}, {k: v[cut:] for k, v in data.items()})
