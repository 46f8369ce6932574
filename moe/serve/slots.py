"""The server's KV-cache rows, kept in place: each block's keys and values of the running sequences are the first
rows of tensors made once (grown by doubling when more sequences run than ever before), so a sequence that joins
copies its own rows in, and one that leaves has only the rows after it moved up, each only in the columns in use.

Concatenating the batch's caches at every join and selecting rows at every leave copied every running row's whole
cache into fresh memory: at 8 sequences of 4096 positions (`small`, bf16) a join took 130 ms beyond its prefill and
a leave 26 ms, beside 23 ms decode steps; sequences that arrive and end at their own times paid that on every one.
The columns past the clock that a moved row leaves behind are never read unmasked: a step writes its column before
it attends to it, and a left move already leaves such columns behind (`moe.serve.batch`).
"""

from __future__ import annotations

import torch

from models.kv_cache import KVCache


class Slots:
    def __init__(self) -> None:
        self.store: dict[str, KVCache] = {}  # per block: rows for the most sequences held so far

    def append(self, caches: dict[str, KVCache], new: dict[str, KVCache], used: int) -> dict[str, KVCache]:
        """`caches` (the store's first rows, or none) with `new`'s rows after them, their columns [0, used) copied;
        each block's rows as views of the store."""
        out = {}
        for name, rows in new.items():
            held = caches[name].k.shape[0] if name in caches else 0
            n = rows.k.shape[0]
            store = self._room(name, rows, held + n, held)
            for kept, given in ((store.k, rows.k), (store.v, rows.v)):
                kept[held:held + n, :, :used] = given[:, :, :used]
            out[name] = _first(store, held + n)
        return out

    def keep(self, kept: dict[str, list[int]], used: int) -> dict[str, KVCache]:
        """Each block's rows `kept[name]` (ascending) moved up to be its first rows, their columns [0, used); the
        rows before the first that leaves stay where they are."""
        out = {}
        for name, rows in kept.items():
            store = self.store[name]
            for to, row in enumerate(rows):
                if row != to:  # row > to: each row is read before any later move writes over it
                    store.k[to, :, :used] = store.k[row, :, :used]
                    store.v[to, :, :used] = store.v[row, :, :used]
            out[name] = _first(store, len(rows))
        return out

    def _room(self, name: str, like: KVCache, need: int, held: int) -> KVCache:
        """The block's store with at least `need` rows; a larger one takes the `held` rows' whole caches along."""
        store = self.store.get(name)
        if store is not None and store.k.shape[0] >= need:
            return store
        rows = max(need, 2 * store.k.shape[0]) if store is not None else need
        grown = KVCache.__new__(KVCache)
        grown.k = torch.zeros((rows, *like.k.shape[1:]), dtype=like.k.dtype, device=like.k.device)
        grown.v = torch.zeros((rows, *like.v.shape[1:]), dtype=like.v.dtype, device=like.v.device)
        if store is not None:
            grown.k[:held], grown.v[:held] = store.k[:held], store.v[:held]
        self.store[name] = grown
        return grown


def _first(store: KVCache, n: int) -> KVCache:
    """The store's first `n` rows as a cache (a view: contiguous, as a cache of n rows made alone)."""
    out = KVCache.__new__(KVCache)
    out.k, out.v = store.k[:n], store.v[:n]
    return out
