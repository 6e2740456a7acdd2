"""Batches of byte windows: random windows for training (grain, checkpointable), every window for evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import grain


def check_corpus(tokens: np.ndarray, seq_len: int, split: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split has {len(tokens)} bytes, shorter than one window of seq_len + 1 = {seq_len + 1}; "
            "use a longer text or a smaller --config.data.seq_len"
        )


def train_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """An endless iterator of ``{"inputs", "targets"}`` (batch_size // process_count, seq_len) int32 batches.

    Window starts are a seeded permutation of every offset, reshuffled each epoch (nanoGPT samples offsets
    uniformly; a permutation visits each once per epoch). Each process takes every ``process_count``-th window.
    ``get_state()`` / ``set_state()`` resume the stream exactly.
    """
    check_corpus(tokens, seq_len, "train")
    if batch_size % process_count:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
    num_windows = len(tokens) - seq_len
    import grain  # loaded when training batches are made, not on import

    ds = grain.MapDataset.range(num_windows).shuffle(seed=seed).repeat(None)
    ds = ds[process_index::process_count]
    ds = ds.map(lambda start: tokens[start : start + seq_len + 1])
    ds = ds.batch(batch_size // process_count, drop_remainder=True)
    ds = ds.map(lambda w: {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)})
    return iter(ds.to_iter_dataset())


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int | None = None) -> Iterator[dict]:
    """Non-overlapping windows that predict every byte after the first exactly once, in fixed-shape batches.

    The last window and the last batch are padded; ``weights`` is 1 for a real target and 0 for padding.
    """
    check_corpus(tokens, 1, "evaluation")
    n = len(tokens) - 1  # targets
    starts = np.arange(0, n, seq_len)
    num_batches = -(-len(starts) // batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for b in range(num_batches):
        inputs = np.zeros((batch_size, seq_len), np.int32)
        targets = np.zeros((batch_size, seq_len), np.int32)
        weights = np.zeros((batch_size, seq_len), np.float32)
        for row, start in enumerate(starts[b * batch_size : (b + 1) * batch_size]):
            length = min(seq_len, n - start)
            inputs[row, :length] = tokens[start : start + length]
            targets[row, :length] = tokens[start + 1 : start + 1 + length]
            weights[row, :length] = 1.0
        yield {"inputs": inputs, "targets": targets, "weights": weights}
