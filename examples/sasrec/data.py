"""Sequence data for the SASRec example: synthetic, MovieLens and Yambda.

Every loader returns a list of per-user item sequences (`numpy` int arrays in
time order) with item ids remapped to `1..num_items`; id 0 is the padding
row of the item table. `split_leave_last_out` holds out each user's last
`holdout` items, and `training_arrays` / `evaluation_arrays` turn the split
into the model's inputs and targets.

Target convention: the targets of a position are the ids of its next
`L = 8` items, padded with **-1**. `CutBCELoss` ignores ids outside
`[0, V)`, so -1 is padding and id 0 (the padding row of the table) never
appears as a target.

Example:

```python
sequences = synthetic_sequences(num_users=500, num_items=2000, seed=0)
train, held_out = split_leave_last_out(sequences, holdout=8)
inputs, targets, weights = training_arrays(train, max_len=50, num_targets=8)
```
"""

import glob
import os

import numpy as np

MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
# SHA-256 of ml-latest-small.zip (the 2018 release: 100,836 ratings, 9,742 movies).
MOVIELENS_SHA256 = "696d65a3dfceac7c45750ad32df2c259311949efec81f0f144fdfb91ebc9e436"

PAD_TARGET = -1


# --------------------------------------------------------------------------- synthetic


def synthetic_sequences(
    num_users=1000,
    num_items=2000,
    *,
    num_genres=20,
    genre_probability=0.7,
    num_successors=3,
    follow_probability=0.5,
    min_len=24,
    max_len=80,
    zipf_exponent=0.8,
    seed=0,
):
    """Users with a favourite genre walking an item-level Markov chain.

    Items have a global Zipf popularity `1 / rank**s` and a genre (random,
    `num_genres` genres of equal size). Every item has `num_successors` fixed successors of
    its own genre (drawn once, Zipf-weighted). A user has one favourite genre
    (drawn by the genres' total popularity) and starts at one of its items;
    at every step, with probability `follow_probability` the next item is a
    not-yet-seen successor of the current item; otherwise (or when all its
    successors were seen) it is a not-yet-seen Zipf-popular item of the
    user's genre with probability `genre_probability`, else of the whole
    catalogue. Each user sees an item at most once (as in MovieLens).

    The next items are therefore predictable from the history (the genre)
    and from the current item (the chain), as in real logs where taste and
    order both matter, while a most-popular baseline only sees the skewed
    marginals.

    Args:
        num_users: number of users.
        num_items: catalogue size (ids `1..num_items`).
        num_genres: number of genres.
        genre_probability: probability that a non-chain step stays in the
            user's genre.
        num_successors: fixed successors per item.
        follow_probability: probability of following the chain.
        min_len, max_len: range of sequence lengths.
        zipf_exponent: exponent `s` of the popularity `1 / rank**s`.
        seed: random seed.

    Returns:
        A list of `num_users` int32 arrays of item ids.

    Example:

    ```python
    seqs = synthetic_sequences(num_users=100, num_items=500, seed=1)
    assert all(s.min() >= 1 and s.max() <= 500 for s in seqs)
    ```
    """
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(num_items) + 1
    weight = ranks.astype(np.float64) ** -zipf_exponent
    num_genres = max(1, min(num_genres, num_items))
    genre_of = rng.permutation(np.arange(num_items) % num_genres)  # equal-sized genres
    members = [np.flatnonzero(genre_of == g) for g in range(num_genres)]

    def sampler(ids):
        cumulative = np.cumsum(weight[ids] / weight[ids].sum())
        return lambda n: ids[np.minimum(np.searchsorted(cumulative, rng.random(n)), len(ids) - 1)]

    everywhere = sampler(np.arange(num_items))
    in_genre = [sampler(m) for m in members]
    successors = np.empty((num_items, num_successors), np.int64)
    for g, m in enumerate(members):
        successors[m] = in_genre[g](len(m) * num_successors).reshape(len(m), num_successors)
    genre_weight = np.array([weight[m].sum() for m in members])
    user_genres = rng.choice(num_genres, size=num_users, p=genre_weight / genre_weight.sum())
    lengths = np.minimum(rng.integers(min_len, max_len + 1, size=num_users), num_items)
    sequences = []
    for genre, length in zip(user_genres, lengths):
        follow = rng.random(length) < follow_probability
        picks = rng.integers(0, num_successors, size=length)
        # Pools of popularity draws for the non-chain steps (seen ones skipped).
        stay = rng.random(4 * length + 16) < genre_probability
        noise = np.where(stay, in_genre[genre](len(stay)), everywhere(len(stay)))
        seen, row, n, current = set(), [], 0, -1
        for t in range(length):
            item = -1
            if current >= 0 and follow[t]:
                options = [int(s) for s in successors[current] if int(s) not in seen]
                if options:
                    item = options[picks[t] % len(options)]
            while item < 0 and n < len(noise):
                if int(noise[n]) not in seen:
                    item = int(noise[n])
                n += 1
            if item < 0:  # the pool is exhausted: any unseen item
                item = next(int(i) for i in rng.permutation(num_items) if int(i) not in seen)
            seen.add(item)
            row.append(item)
            current = item
        sequences.append(np.asarray(row, np.int32) + 1)
    return sequences


# --------------------------------------------------------------------------- real data


def _group_sequences(users, items, times):
    """Per-user item sequences sorted by time, ids remapped to `1..V`.

    Returns `(sequences, num_items)`.
    """
    users = np.asarray(users)
    items = np.asarray(items)
    times = np.asarray(times)
    unique_items, dense = np.unique(items, return_inverse=True)
    dense = dense.astype(np.int32) + 1
    order = np.lexsort((times, users))  # by user, then time (stable)
    users, dense = users[order], dense[order]
    boundaries = np.flatnonzero(np.diff(users)) + 1
    sequences = np.split(dense, boundaries)
    return [s for s in sequences if len(s)], len(unique_items)


def _find(data_dir, names):
    for name in names:
        for path in (os.path.join(data_dir, name), *glob.glob(os.path.join(data_dir, "*", name))):
            if os.path.exists(path):
                return path
    return None


def download_movielens(cache_dir=None):
    """Downloads and extracts ml-latest-small with `keras.utils.get_file`.

    The archive is checked against its SHA-256. Raises `RuntimeError` with
    instructions when the download fails (e.g. offline).
    """
    import keras

    try:
        path = keras.utils.get_file(
            "ml-latest-small.zip",
            MOVIELENS_URL,
            file_hash=MOVIELENS_SHA256,
            extract=True,
            cache_dir=cache_dir,
            cache_subdir="datasets",
        )
    except Exception as error:  # network errors come in many types
        raise RuntimeError(
            f"Could not download MovieLens from {MOVIELENS_URL} ({type(error).__name__}: "
            f"{error}). If this machine is offline, download and unzip ml-latest-small "
            "elsewhere and pass its folder with --data-dir DIR (it must contain "
            "ratings.csv or ratings.dat)."
        ) from error
    return path


def load_movielens(data_dir=None, *, min_interactions=10, cache_dir=None):
    """MovieLens ratings as per-user sequences in time order.

    Reads `ratings.csv` (ml-latest-small format:
    `userId,movieId,rating,timestamp` with a header) or `ratings.dat`
    (ML-1M format: `UserID::MovieID::Rating::Timestamp`) from `data_dir` or
    one of its sub-folders. Every rating counts as an interaction; users with
    fewer than `min_interactions` ratings are dropped. Without `data_dir` the
    archive is downloaded (`download_movielens`).

    Returns:
        `(sequences, num_items)`: list of int32 arrays with ids `1..num_items`.

    Example:

    ```python
    sequences, num_items = load_movielens("/data/ml-latest-small")
    ```
    """
    import pandas as pd

    if data_dir is None:
        data_dir = download_movielens(cache_dir)
    csv = _find(data_dir, ["ratings.csv"])
    dat = _find(data_dir, ["ratings.dat"])
    if csv is not None:
        frame = pd.read_csv(csv)
        frame.columns = [c.strip() for c in frame.columns]
        users, items, times = frame["userId"], frame["movieId"], frame["timestamp"]
    elif dat is not None:
        frame = pd.read_csv(
            dat, sep="::", engine="python", header=None,
            names=["user", "item", "rating", "timestamp"],
        )
        users, items, times = frame["user"], frame["item"], frame["timestamp"]
    else:
        raise FileNotFoundError(
            f"No ratings.csv or ratings.dat in {data_dir!r} (or its sub-folders)."
        )
    sequences, num_items = _group_sequences(users.to_numpy(), items.to_numpy(), times.to_numpy())
    sequences = [s for s in sequences if len(s) >= min_interactions]
    return sequences, num_items


def load_yambda(data_dir, *, min_interactions=10, max_files=None):
    """Yambda events (parquet) as per-user sequences in time order.

    Reads every `*.parquet` file under `data_dir` (recursively) with the
    columns `uid`, `item_id`, `timestamp` (the flat Yambda layout, e.g.
    `listens.parquet`, `likes.parquet`); every event counts as an
    interaction. Requires `pyarrow` (`pip install keras-cutbce-erase[yambda]`).

    Returns:
        `(sequences, num_items)`.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(
            "--data yambda reads parquet files and needs pyarrow: "
            "pip install 'keras-cutbce-erase[yambda]' (or pip install pyarrow)."
        ) from error
    files = sorted(glob.glob(os.path.join(data_dir, "**", "*.parquet"), recursive=True))
    if max_files:
        files = files[:max_files]
    if not files:
        raise FileNotFoundError(f"No .parquet files under {data_dir!r}.")
    users, items, times = [], [], []
    for path in files:
        table = pq.read_table(path, columns=["uid", "item_id", "timestamp"])
        users.append(table.column("uid").to_numpy())
        items.append(table.column("item_id").to_numpy())
        times.append(table.column("timestamp").to_numpy())
    sequences, num_items = _group_sequences(
        np.concatenate(users), np.concatenate(items), np.concatenate(times)
    )
    sequences = [s for s in sequences if len(s) >= min_interactions]
    return sequences, num_items


# --------------------------------------------------------------------------- split and arrays


def split_leave_last_out(sequences, holdout=8, min_train=2):
    """Holds out each user's last `holdout` items.

    Users with fewer than `holdout + min_train` items are dropped.

    Returns:
        `(train, held_out)`: lists of int32 arrays, `held_out[u]` has
        exactly `holdout` items.
    """
    train, held_out = [], []
    for s in sequences:
        if len(s) >= holdout + min_train:
            train.append(np.asarray(s[:-holdout], dtype=np.int32))
            held_out.append(np.asarray(s[-holdout:], dtype=np.int32))
    return train, held_out


def _next_items(sequence, num_targets):
    """`[T, num_targets]` next items of every position, -1 past the end."""
    length = len(sequence)
    padded = np.concatenate([sequence, np.full(num_targets, PAD_TARGET, np.int32)])
    offsets = np.arange(length)[:, None] + 1 + np.arange(num_targets)[None, :]
    return padded[offsets]


def training_arrays(train, max_len=50, num_targets=8):
    """Left-padded input windows, next-items targets and position weights.

    Each user's training sequence is cut, from its end, into windows of
    `max_len` items. Position `t` of a window targets the next
    `num_targets` items of the user's training sequence (which may lie
    beyond the window; the held-out items never appear). Padding positions
    and positions with no next item get weight 0.

    Returns:
        `inputs [W, max_len]` int32 (0 = padding), `targets [W, max_len,
        num_targets]` int32 (-1 = padding), `weights [W, max_len]` float32.
    """
    inputs, targets, weights = [], [], []
    for s in train:
        nxt = _next_items(s, num_targets)
        for end in range(len(s), 0, -max_len):
            start = max(0, end - max_len)
            pad = max_len - (end - start)
            x = np.zeros(max_len, np.int32)
            y = np.full((max_len, num_targets), PAD_TARGET, np.int32)
            x[pad:] = s[start:end]
            y[pad:] = nxt[start:end]
            inputs.append(x)
            targets.append(y)
            weights.append((y >= 0).any(axis=-1).astype(np.float32))
    return np.stack(inputs), np.stack(targets), np.stack(weights)


def evaluation_arrays(train, held_out, max_len=50):
    """Inputs for leave-last-out evaluation.

    Returns:
        `inputs [U, max_len]` (the last `max_len` training items, left
        padded), `held_out [U, holdout]` int32, and `seen [U, H]` int32: each
        user's whole training history plus id 0 (the padding row), padded
        with -1, to exclude from the ranking.
    """
    inputs = np.zeros((len(train), max_len), np.int32)
    width = max(len(s) for s in train) + 1
    seen = np.full((len(train), width), PAD_TARGET, np.int32)
    for u, s in enumerate(train):
        tail = s[-max_len:]
        inputs[u, max_len - len(tail) :] = tail
        seen[u, 0] = 0
        seen[u, 1 : len(s) + 1] = s
    return inputs, np.stack(held_out).astype(np.int32), seen


def item_counts(train, num_items):
    """Training interaction count of every id `0..num_items` (0 stays 0)."""
    counts = np.zeros(num_items + 1, np.int64)
    for s in train:
        np.add.at(counts, s, 1)
    return counts
