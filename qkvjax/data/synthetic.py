"""Synthetic sequence tasks on digits 0-9: each maps an input sequence (B, L) to per-position targets (B, L).

* ``copy``: y_i = x_i.                       * ``sub``: y_i = 9 - x_i.
* ``reverse``: y_i = x_{L-1-i}.              * ``sort``: y = the digits in ascending order.
* ``swap``: the two halves exchanged, y_i = x_{(i + L/2) mod L} (L even).
* ``left``: the directional probe, y_i = x_{i-1}, and y_0 = 10 ("no left neighbour"; 11 classes).

Why ``left`` separates the schemes. Position i must read i - 1 and not i + 1, a relation that holds from i to j but
not from j to i. With shared QK (W^Q = W^K; also ``shared_qkv`` and Reformer's ``reformer_qk``) every score is
symmetric, s(i, j) = s(j, i): q_i . k_j = x_i^T W W^T x_j, and with rotary positions x_i^T W R_{j-i} W^T x_j, which
is symmetric too because R_{i-j} = R_{j-i}^T (tested in tests/test_synthetic.py). So the positional part of a score
cannot prefer left over right: with learned positions p_i^T W W^T p_j is symmetric, and with rotary positions two
equal tokens score the same at offsets +d and -d. A tied model can still solve ``left``, but only indirectly:
through content (x_i^T W R_d W^T x_j differs from x_i^T W R_{-d} W^T x_j when x_i != x_j; we expect it to fail where
neighbouring digits repeat), or by ordering the scores along the sequence, s(1, 0) > s(2, 1) > ..., which the per-
row softmax allows but which is fragile. Every scheme with W^Q != W^K (``separate``, ``shared_kv``, ``shared_qv``,
``bilinear``), and any scheme with the asymmetric relative bias b(j - i), can put the score peak at j = i - 1 with a
positional rule that holds for every content. ``reverse`` and ``swap`` pair positions symmetrically (i <-> L-1-i, i
<-> i + L/2), so symmetric scores are no obstacle there; they need absolute positions, which rotary embeddings alone
do not give.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

DIGITS = 10


def _swap(x):
    half = x.shape[1] // 2
    return np.concatenate([x[:, half:], x[:, :half]], axis=1)


def _left(x):
    return np.concatenate([np.full((x.shape[0], 1), DIGITS, x.dtype), x[:, :-1]], axis=1)


TASKS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], int]] = {  # name -> (targets of inputs, classes)
    "copy": (lambda x: x.copy(), DIGITS),
    "sub": (lambda x: DIGITS - 1 - x, DIGITS),
    "reverse": (lambda x: x[:, ::-1].copy(), DIGITS),
    "sort": (lambda x: np.sort(x, axis=1), DIGITS),
    "swap": (_swap, DIGITS),
    "left": (_left, DIGITS + 1),
}


def check_task(task: str, length: int) -> None:
    """ValueError naming the bad value and what is allowed."""
    if not isinstance(task, str) or task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"sequence length {length!r}; allowed: an integer >= 2")
    if task == "swap" and length % 2:
        raise ValueError(f"task 'swap' exchanges two halves, so it needs an even length; got {length}")


def targets(task: str, inputs: np.ndarray) -> np.ndarray:
    check_task(task, inputs.shape[1])
    return TASKS[task][0](inputs).astype(np.int32)


def num_classes(task: str) -> int:
    return TASKS[task][1]


class TaskData:
    """A fixed held-out evaluation set and an endless stream of training batches that never contains one of its
    sequences (checked by content, so it holds even for short lengths where repeats are likely)."""

    def __init__(self, task: str, length: int, seed: int, eval_size: int = 1000):
        check_task(task, length)
        self.task, self.length = task, length
        rng = np.random.default_rng([seed, 1])
        self.eval_inputs = rng.integers(0, DIGITS, (eval_size, length), dtype=np.int32)
        self.eval_targets = targets(task, self.eval_inputs)
        self._held_out = {row.tobytes() for row in self.eval_inputs}
        if len(self._held_out) >= DIGITS**length:
            raise ValueError(f"length {length} has only {DIGITS**length} sequences: none left to train on")
        self._rng = np.random.default_rng([seed, 2])

    def batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        x = self._rng.integers(0, DIGITS, (batch_size, self.length), dtype=np.int32)
        for i in range(batch_size):
            while x[i].tobytes() in self._held_out:
                x[i] = self._rng.integers(0, DIGITS, self.length, dtype=np.int32)
        return x, targets(self.task, x)
