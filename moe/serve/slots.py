"""The server's KV-cache rows, kept in place: each block's keys and values of the running sequences are the first
rows of tensors made once, for the server's most sequences (`--max-num-seqs`, the rows checked to fit at start), so
a sequence that joins copies its own rows in, and one that leaves has only the rows after it moved up, each only in
the columns in use.

Concatenating the batch's caches at every join and selecting rows at every leave copied every running row's whole
cache into fresh memory: at 8 sequences of 4096 positions (`small`, bf16) a join took 130 ms beyond its prefill and
a leave 26 ms, beside 23 ms decode steps; sequences that arrive and end at their own times paid that on every one.
The columns past the clock that a moved row leaves behind are never read unmasked: a step writes its column before
it attends to it, and a left move already leaves such columns behind (`moe.serve.batch`).
"""

from __future__ import annotations

from models.kv_cache import KVCache


class Slots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # rows of each block's store: the most sequences a rank holds
        self.store: dict[str, KVCache] = {}  # per block, made at its first rows

    def append(self, caches: dict[str, KVCache], new: dict[str, KVCache], used: int) -> dict[str, KVCache]:
        """`caches` (the store's first rows, or none) with `new`'s rows after them, their columns [0, used) copied;
        each block's rows as views of the store."""
        out = {}
        for name, rows in new.items():
            held = caches[name].k.shape[0] if name in caches else 0
            n = rows.k.shape[0]
            if held + n > self.capacity:
                raise RuntimeError(f"{held + n} sequences' cache rows asked of a store of {self.capacity}")
            store = self.store.get(name) or self._made(name, rows)
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

    def _made(self, name: str, like: KVCache) -> KVCache:
        """The block's store: `capacity` rows shaped as `like`'s."""
        _, heads, length, head_dim = like.k.shape
        store = self.store[name] = KVCache(self.capacity, heads, length, head_dim, like.k.dtype, like.k.device,
                                           like.v.shape[3])
        return store


def _first(store: KVCache, n: int) -> KVCache:
    """The store's first `n` rows as a cache (a view: contiguous, as a cache of n rows made alone)."""
    return KVCache.holding(store.k[:n], store.v[:n])
