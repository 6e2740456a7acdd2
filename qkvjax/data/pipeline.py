"""Batches of byte windows: random windows for training (grain, checkpointable), every window for evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import grain


def check_corpus(tokens, seq_len: int, split: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split has {len(tokens)} tokens, shorter than one window of seq_len + 1 = {seq_len + 1}; "
            "use a longer text or a smaller --config.data.seq_len"
        )


def train_batches(
    tokens,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    sampling: str = "random",
    workers: int = 0,
    start_batch: int = 0,
) -> grain.DatasetIterator:
    """An endless iterator of ``{"inputs", "targets"}`` (batch_size // process_count, seq_len) int32 batches.

    ``tokens``: an array, or a prepared split (:class:`qkvjax.data.shards.TokenSequence`). ``sampling``:

    * ``disjoint``: windows at multiples of ``seq_len`` (every target in exactly one window), in a seeded order
      reshuffled each epoch, so each target is trained on once per epoch (MaxText's and Levanter's packed
      sequences);
    * ``random``: a window at every offset, in a seeded permutation reshuffled each epoch (nanoGPT samples
      offsets uniformly; a permutation visits each once per epoch, but the windows overlap, so targets repeat
      within an epoch).

    Each process takes every ``process_count``-th window. ``workers`` > 0 reads batches in that many grain worker
    processes. ``start_batch``: the first batches of the order are skipped (an uptraining run continuing another's
    order). ``get_state()`` / ``set_state()`` resume the stream exactly.
    """
    from qkvjax.data.shards import SAMPLINGS, _Gather, window_count

    if sampling not in SAMPLINGS:
        raise ValueError(f"data.sampling={sampling!r}; allowed: {', '.join(SAMPLINGS)}")
    check_corpus(tokens, seq_len, "train")
    if batch_size % process_count:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
    num_windows = window_count(len(tokens), seq_len, sampling)
    import grain  # loaded when training batches are made, not on import

    ds = grain.MapDataset.range(num_windows).shuffle(seed=seed).repeat(None)
    ds = ds[process_index::process_count]
    ds = ds.batch(batch_size // process_count, drop_remainder=True)
    ds = ds[start_batch:] if start_batch else ds  # the order continued where another run stopped
    # One gather per batch (not a map per window): grain's per-element overhead would bound the tokens/s.
    ds = ds.map(_Gather(tokens, seq_len, seq_len if sampling == "disjoint" else 1))
    # grain's default read-ahead holds 500 batches: 2 GB of host memory at gpt2_124m's 480 x 1025 tokens; 16 keep
    # the step fed (benchmarks/README.md, "The data path")
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=16, prefetch_buffer_size=16))
    if workers:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; qkvjax's CLI parses its own arguments
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(it)


def check_stride(stride, seq_len: int) -> int:
    """``stride`` when an evaluation can slide its windows by it, else a one-line refusal."""
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride!r}; allowed: an int in [1, seq_len={seq_len}] (the windows' length)")
    return stride


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int | None = None, stride: int | None = None
) -> Iterator[dict]:
    """Windows that predict every byte after the first exactly once, in fixed-shape batches; with ``max_batches``
    fewer than that takes, ``max_batches`` full batches of windows spread evenly over the split.

    Without ``stride`` (or ``stride == seq_len``) the windows do not overlap: a target's context is whatever of its
    window precedes it, 0 to ``seq_len - 1`` tokens. With ``stride`` S < ``seq_len``, the sliding-window evaluation
    of fixed-length models (Hugging Face's perplexity guide; Press et al. 2021, arXiv:2012.15832): after the first
    window each window ends S targets further on and scores only those, so every target past the first window sees
    at least ``seq_len - S`` tokens before it, for ``seq_len / S`` times the compute.

    The last window and the last batch are padded; ``weights`` is 1 for a scored target and 0 otherwise.
    """
    if len(tokens) < 2:  # one target after one token of context
        raise ValueError(
            f"the evaluated split has {len(tokens)} tokens; evaluation needs at least 2; use a longer text"
        )
    n = len(tokens) - 1  # targets
    stride = seq_len if stride is None else check_stride(stride, seq_len)
    spans, done = [], 0  # (window start, window length, its first scored place); the targets scored so far
    for start in range(0, n, stride):  # windows at every stride, as the guide's loop: the last one shorter
        end = min(start + seq_len, n)
        spans.append((start, end - start, done - start))
        done = end
        if end == n:
            break
    num_batches = -(-len(spans) // batch_size)
    if max_batches is not None and max_batches < num_batches:
        # A sample of the split, not its prefix: a text's split keeps its documents in order, so the first windows
        # are one or two documents (the Linux corpus' first 16 KB of validation scored 2.2 nats, the whole split
        # 1.24). Windows evenly spaced over the split instead, the same ones at every evaluation; each still
        # scores only the targets its stride adds (distinct: the split holds more than the sample's windows).
        keep = np.linspace(0, len(spans) - 1, max_batches * batch_size).round().astype(int)
        spans, num_batches = [spans[i] for i in keep], max_batches
    for b in range(num_batches):
        inputs = np.zeros((batch_size, seq_len), np.int32)
        targets = np.zeros((batch_size, seq_len), np.int32)
        weights = np.zeros((batch_size, seq_len), np.float32)
        for row, (start, length, first) in enumerate(spans[b * batch_size : (b + 1) * batch_size]):
            inputs[row, :length] = tokens[start : start + length]
            targets[row, :length] = tokens[start + 1 : start + 1 + length]
            weights[row, first:length] = 1.0
        yield {"inputs": inputs, "targets": targets, "weights": weights}


def targets_repeated(num_tokens: int, seq_len: int, batch_size: int, seed: int, steps: int,
                     sampling: str = "random", process_count: int = 1) -> tuple[int, int]:  # fmt: skip
    """``(repeated, trained)``: of the targets a run's first ``steps`` batches trained on (``trained`` = steps x
    batch x seq_len), how many it had trained on before. Counted by replaying :func:`train_batches`' own window
    order (the same grain dataset, every process's share) over a bitmap of the split's targets, not estimated."""
    import grain

    from qkvjax.data.shards import window_count

    stride = seq_len if sampling == "disjoint" else 1
    seen = np.zeros(num_tokens, bool)  # seen[i]: token i has been a target
    repeated = 0
    base = grain.MapDataset.range(window_count(num_tokens, seq_len, sampling)).shuffle(seed=seed).repeat(None)
    for p in range(process_count):
        ds = base[p::process_count].batch(batch_size // process_count, drop_remainder=True)
        for step in range(steps):
            for i in ds[step]:
                a = int(i) * stride + 1  # a window starting at s predicts tokens s + 1 .. s + seq_len
                repeated += int(np.count_nonzero(seen[a : a + seq_len]))
                seen[a : a + seq_len] = True
    return repeated, steps * (batch_size // process_count) * process_count * seq_len
