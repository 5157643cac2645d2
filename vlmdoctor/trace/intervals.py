"""Interval arithmetic on sorted, disjoint intervals (GPU busy time, idle gaps, step windows), vectorized."""

from __future__ import annotations

import numpy as np

Intervals = tuple[np.ndarray, np.ndarray]


def union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    if len(starts) == 0:
        return np.zeros(0), np.zeros(0)
    o = np.argsort(starts, kind="mergesort")
    s, e = np.asarray(starts, dtype=float)[o], np.asarray(ends, dtype=float)[o]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]  # a new run starts where nothing before reaches this start
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _member(iv: Intervals, x: np.ndarray) -> np.ndarray:
    if len(iv[0]) == 0:  # an empty set (no data-loader ops, no syncs, no kernels): nothing is a member
        return np.zeros(len(x), dtype=bool)
    k = np.searchsorted(iv[0], x, side="right") - 1
    return (k >= 0) & (x < iv[1][np.maximum(k, 0)])


def _combine(a: Intervals, b: Intervals, keep) -> Intervals:
    pts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    if len(pts) < 2:
        return np.zeros(0), np.zeros(0)
    lo, hi = pts[:-1], pts[1:]
    mid = (lo + hi) / 2
    m = keep(_member(a, mid), _member(b, mid))
    return union(lo[m], hi[m])


def intersect(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, lambda x, y: x & y)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, lambda x, y: x & ~y)


def total(iv: Intervals) -> float:
    return float(np.sum(iv[1] - iv[0]))


def _measure(iv: Intervals, x: np.ndarray) -> np.ndarray:
    """Length of iv inside (-inf, x], for many x at once."""
    s, e = iv
    if len(s) == 0:
        return np.zeros(len(np.atleast_1d(x)))
    cum = np.concatenate([[0.0], np.cumsum(e - s)])
    k = np.searchsorted(s, x, side="right")
    over = np.where(k > 0, np.maximum(e[np.maximum(k - 1, 0)] - x, 0.0), 0.0)
    return cum[k] - over


def per_window(iv: Intervals, windows: list[tuple[float, float]]) -> np.ndarray:
    """Length of iv inside each (start, end) window: one step's share of a set the facts give per step."""
    ws, we = np.array([s for s, _ in windows], dtype=float), np.array([e for _, e in windows], dtype=float)
    return _measure(iv, we) - _measure(iv, ws)
