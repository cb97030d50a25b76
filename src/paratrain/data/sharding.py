"""This rank's part of the data, such that the union over ranks is exactly the single-process data.

Used by ``pt.shard`` (:mod:`paratrain.api`) and by tasks. With world_size W and a
global batch of B samples, every rank must see B/W samples of every step and the
W parts must add up to the single-process batch (no sample twice, none lost):

* :func:`shard_tensor`: a tensor batchified into B parallel streams, ``(L, B)``
  (``word_language_model``'s ``batchify``): rank r gets the contiguous columns
  ``[r*B/W, (r+1)*B/W)`` (``dim`` picks another dimension);
* :class:`ShardedLoader`: a ``DataLoader`` with batch size B becomes one with batch
  size B/W and a ``DistributedSampler`` (shuffled with a seed shared by the ranks,
  ``drop_last``): step i's W batches together are the single-process batch i of the
  same sampler with W = 1. ``set_epoch`` is called for you at every new iteration;
* :class:`ShardedDataset`: a map-style dataset seen through ``DistributedSampler``'s
  permutation (rank r's item i is global item ``perm[i*W + r]``); call
  ``set_epoch(epoch)`` before each epoch and batch it with B/W per rank, unshuffled;
* :class:`ShardedIterable`: an iterable of global batches: each rank gets its
  contiguous block of every batch along ``dim``.

A size that does not divide by W is a ValueError naming the numbers, unless
``allow_uneven=True`` (then the parts differ by at most one: :func:`shard_range`).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share when n items are cut into world_size
    nearly equal parts (sizes differ by at most one; the parts cover 0..n exactly once)."""
    return (n * rank) // world_size, (n * (rank + 1)) // world_size


def _even(n: int, world_size: int, what: str, allow_uneven: bool) -> None:
    if n % world_size and not allow_uneven:
        raise ValueError(f"{what} of {n} does not split evenly over world_size {world_size}; use a multiple of "
                         f"{world_size} (or allow_uneven=True: the parts then differ by one)")


def shard_tensor(data: torch.Tensor, rank: int, world_size: int, dim: int = 1,
                 allow_uneven: bool = False) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of ``data`` along ``dim`` (default 1: the streams of a
    batchified ``(L, B)`` tensor), itself contiguous in memory like the tensor it replaces (code
    written for the whole tensor, e.g. ``source[i:j].view(-1)``, keeps working); same device and dtype."""
    if data.dim() <= dim:
        raise ValueError(f"a {data.dim()}-d tensor has no dimension {dim} to shard; pass dim= (0 for rows, 1 for "
                         f"the streams of a batchified (L, B) tensor)")
    n = data.size(dim)
    _even(n, world_size, f"dimension {dim}", allow_uneven)
    lo, hi = shard_range(n, world_size, rank)
    return data.narrow(dim, lo, hi - lo).contiguous()


def split_batch(batch: Any, rank: int, world_size: int, dim: int = 0, allow_uneven: bool = False) -> Any:
    """Rank's contiguous block of a batch: tensors split along ``dim``, containers walked, other
    objects unchanged."""
    if isinstance(batch, torch.Tensor):
        return shard_tensor(batch, rank, world_size, dim, allow_uneven) if batch.dim() > dim else batch
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(x, rank, world_size, dim, allow_uneven) for x in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, dict):
        return {k: split_batch(v, rank, world_size, dim, allow_uneven) for k, v in batch.items()}
    return batch


class ShardedIterable:
    """Each item (a global batch) of ``source`` cut to this rank's block along ``dim``."""

    def __init__(self, source: Iterable, rank: int, world_size: int, dim: int = 0, allow_uneven: bool = False) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size
        self.dim, self.allow_uneven = dim, allow_uneven

    def __iter__(self) -> Iterator[Any]:
        for batch in self.source:
            yield split_batch(batch, self.rank, self.world_size, self.dim, self.allow_uneven)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]


class ShardedDataset(torch.utils.data.Dataset):
    """A map-style dataset as rank ``rank`` sees it: item i is ``dataset[perm[i * W + rank]]`` with
    ``perm`` the epoch's permutation (``torch.randperm`` seeded by ``seed + epoch``, the same on every
    rank; the identity without ``shuffle``), the tail that does not fill all W ranks dropped
    (``DistributedSampler(drop_last=True)``'s order). Call :meth:`set_epoch` before every epoch."""

    def __init__(self, dataset, rank: int, world_size: int, shuffle: bool = True, seed: int = 0) -> None:
        from torch.utils.data import DistributedSampler

        self.dataset = dataset
        self.sampler = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=True)
        self._indices = list(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self._indices = list(self.sampler)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self._indices[i]]


class ShardedLoader:
    """A ``DataLoader`` of global batches remade for rank ``rank``: batch size B/W, a
    ``DistributedSampler`` (shuffled like the original loader, seed shared by the ranks,
    ``drop_last`` like the original), the other loader settings kept. Iterating it again
    starts the next epoch (``set_epoch`` is called for you; :meth:`set_epoch` sets it explicitly)."""

    def __init__(self, loader, rank: int, world_size: int, seed: int = 0, allow_uneven: bool = False) -> None:
        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

        if loader.batch_size is None:
            raise ValueError("pt.shard needs a DataLoader with a batch_size (a global batch per step)")
        _even(loader.batch_size, world_size, "the DataLoader's batch_size (the global batch)", allow_uneven)
        lo, hi = shard_range(loader.batch_size, world_size, rank)
        shuffle = isinstance(loader.sampler, RandomSampler)
        self.sampler = DistributedSampler(loader.dataset, world_size, rank, shuffle=shuffle, seed=seed,
                                          drop_last=loader.drop_last)
        self.loader = DataLoader(loader.dataset, batch_size=hi - lo, sampler=self.sampler,
                                 num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                 pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                                 timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                                 persistent_workers=loader.persistent_workers if loader.num_workers else False)
        self.epoch = 0
        self.batch_size = hi - lo
        self.dataset = loader.dataset

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration shuffles for (otherwise each iteration counts one up)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def shard(data: Any, rank: int, world_size: int, *, dim: int | None = None, seed: int = 0,
          allow_uneven: bool = False) -> Any:
    """This rank's part of ``data`` (see the module docstring): a tensor (``dim`` default 1), a
    ``DataLoader``, a map-style dataset or an iterable of global batches (``dim`` default 0).
    Raises ValueError for uneven splits (unless ``allow_uneven``) and TypeError for other objects."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if isinstance(data, torch.Tensor):
        return shard_tensor(data, rank, world_size, 1 if dim is None else dim, allow_uneven)
    if isinstance(data, DataLoader):
        return ShardedLoader(data, rank, world_size, seed, allow_uneven)
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset) and hasattr(data, "__len__"):
        return ShardedDataset(data, rank, world_size, seed=seed)
    if isinstance(data, Iterable):
        return ShardedIterable(data, rank, world_size, 0 if dim is None else dim, allow_uneven)
    raise TypeError(f"pt.shard takes a tensor, a DataLoader, a map-style dataset or an iterable of batches, "
                    f"not {type(data).__name__}")
