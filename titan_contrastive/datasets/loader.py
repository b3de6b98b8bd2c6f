"""Data-parallel loading: a blocked distributed sampler and an endless, resumable epoch loop.

Three guarantees, each tested in tests/test_data.py:
1. Rank-count invariance. At step s of an epoch, rank r of W gets `perm[s*G + r*b : s*G + (r+1)*b]`
   (b = local batch, G = b*W): the global batch (ranks concatenated in order) is a fixed slice
   of the epoch's permutation, so 1 process x 16 and 2 processes x 8 train on the same samples.
   torch's DistributedSampler deals indices round-robin (`perm[r::W]`), which breaks this.
2. Per-sample randomness depends only on (seed, epoch, index): see `ImageTextDataset`.
3. Exact resumption. `EpochLoader.state_dict()` holds the epoch and the StatefulDataLoader's
   state (which includes the sampler's position), so a restored run yields exactly the batch the
   uninterrupted run would have, also across epoch boundaries.

With `source_sizes` (`data.same_source_batches` over `::`-joined sources) every optimizer step's
samples (`step_samples`: local batch x ranks x accumulation steps) come from one source: the
epoch's order is each source's own permutation cut into whole steps (its remainder left out of that
epoch), the steps of all sources shuffled together, so a source is drawn in proportion to its steps
(sentence-transformers' proportional multi-dataset sampler). Guarantees 1 to 3 hold as they are.
"""

from __future__ import annotations

import ctypes
import gc
import math
import signal
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_contrastive.components.preemption import STOP_SIGNALS
from titan_contrastive.datasets.bad_samples import BadSampleLog
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.protocol import Dataset

T = TypeVar("T")


class BlockedDistributedSampler(Sampler[int]):
    """This rank's indices for one epoch, in blocks of `local_batch_size` (guarantee 1 above).

    The epoch's permutation is `torch.randperm(n)` seeded with `seed + epoch` (as in
    DistributedSampler). An epoch is cut into whole optimizer steps of `step_samples` (local batch x ranks x
    accumulation steps; one loader step, G, where 0): with `drop_last` the trailing n mod step_samples samples are
    dropped; without it the permutation wraps around to fill the last step, so every rank has equal steps. No
    optimizer step then spans two epochs (whose permutations could put one sample in it twice), and the epoch's
    order does not depend on how the step is split into ranks and microbatches (`EpochLoader.load_resharded`).
    State is (epoch, yielded), the same protocol as torchdata's StatefulDistributedSampler,
    so StatefulDataLoader saves and restores it. `source_sizes`: batches of one source per step (module
    docstring); the tails are then always dropped.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        local_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        source_sizes: Sequence[int] = (),
        step_samples: int = 0,
    ) -> None:
        self.dataset_len = dataset_len
        self.local_batch_size = local_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.yielded = 0
        self._resume_at: int | None = None
        global_batch = local_batch_size * world_size
        self.source_sizes, self.step_samples = list(source_sizes), step_samples or global_batch
        if self.step_samples % global_batch or (self.source_sizes and sum(self.source_sizes) != dataset_len):
            raise ValueError(
                f"step_samples={step_samples} must be a multiple of the {global_batch} samples a loader step "
                f"takes, and source_sizes={self.source_sizes} must add up to the {dataset_len} samples"
            )
        if self.source_sizes:
            steps = sum(size // self.step_samples for size in self.source_sizes)
        else:
            steps = dataset_len // self.step_samples if drop_last else math.ceil(dataset_len / self.step_samples)
        self.steps_per_epoch = steps * (self.step_samples // global_batch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._resume_at = epoch, None

    def global_order(self) -> torch.Tensor:
        """The epoch's sample order over all ranks, trimmed or wrapped to whole global batches."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.source_sizes:
            return self._source_steps(generator)
        if self.shuffle:
            order = torch.randperm(self.dataset_len, generator=generator)
        else:
            order = torch.arange(self.dataset_len)
        total = self.steps_per_epoch * self.local_batch_size * self.world_size
        return order.repeat(math.ceil(total / self.dataset_len))[:total]

    def _source_steps(self, generator: torch.Generator) -> torch.Tensor:
        """Each source's permutation cut into whole optimizer steps, the steps of all sources shuffled."""
        steps, start = [], 0
        for size in self.source_sizes:
            order = start + (torch.randperm(size, generator=generator) if self.shuffle else torch.arange(size))
            steps.extend(order[: size // self.step_samples * self.step_samples].split(self.step_samples))
            start += size
        pick = torch.randperm(len(steps), generator=generator).tolist() if self.shuffle else range(len(steps))
        return torch.cat([steps[i] for i in pick])

    def __iter__(self) -> Iterator[int]:
        # eager (not a generator body): `yielded` is right even before the first index is drawn; a restored position
        # holds until one is (a loader with workers calls this twice before drawing) or the epoch changes
        start = self._resume_at or 0
        self.yielded = start
        blocks = self.global_order().view(self.steps_per_epoch, self.world_size, self.local_batch_size)
        return self._count(blocks[:, self.rank].reshape(-1)[start:].tolist())

    def _count(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._resume_at = None
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return self.steps_per_epoch * self.local_batch_size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore; the next `__iter__` continues that epoch after the yielded indices."""
        self.epoch = state_dict["epoch"]
        self.yielded = self._resume_at = state_dict["yielded"]


def passthrough_collate(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`ImageTextDataset.__getitems__` already returns the batch dict (module level: picklable)."""
    return batch


class EpochLoader:
    """An endless iterator of local batches that moves to the next epoch by itself.

    `StatefulDataLoader` covers one epoch; the trainer wants steps. On the end of an epoch this
    advances the epoch of both the sampler (new permutation) and the dataset (new per-sample
    randomness) and starts the next. The dataset's epoch is set before each `iter()`, which is
    when worker processes copy the dataset (persistent workers are off for this reason).
    `state_dict()` / `load_state_dict()` follow torch.distributed.checkpoint's Stateful protocol.
    Skipped bad samples are taken out of each batch and counted here (`bad_samples`).
    """

    def __init__(
        self,
        dataloader: StatefulDataLoader,
        sampler: BlockedDistributedSampler,
        dataset: Dataset,
        bad_samples: BadSampleLog,
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.dataset = dataset
        self.bad_samples = bad_samples
        self.epoch = 0
        self.served: int | None = 0
        """Batches served in this epoch: its global order's first `served` x G samples (None: not known, after
        loading a state that predates the count, until the next epoch)."""
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None
        self._set_epoch(0)
        self._source_ends = torch.tensor(sampler.source_sizes, dtype=torch.long).cumsum(0)
        parts = str(dataset.source).split("::") if sampler.source_sizes else []
        names = [Path(p.rstrip("/")).name or p for p in parts]
        self.source_names = names if len(set(names)) == len(names) else parts
        """With one source per step, each `::`-joined source's file or folder name (the whole part where two
        parts share a name); else []."""
        self.step_source: str | None = None
        """The source of the batches just served, when every step is one source's (`data.same_source_batches`):
        its name in `source_names`; else None."""

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def _set_epoch(self, epoch: int, served: int | None = 0) -> None:
        self.epoch, self.served = epoch, served
        # the seed the epoch's iterator draws for its workers, a function of the epoch: a run resumed where an epoch
        # ended starts the next one's workers as the uninterrupted run does
        self.dataloader.generator.manual_seed(self.sampler.seed + epoch)
        self.sampler.set_epoch(epoch)
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> EpochLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = started(self.dataloader)
        try:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._set_epoch(self.epoch + 1)
                self._iterator = started(self.dataloader)
                batch = next(self._iterator)  # build_dataloader guarantees at least one batch per epoch
        except DataError as e:  # from a worker, the message holds the worker's traceback: keep its last line
            raise DataError(str(e).strip().splitlines()[-1].split("DataError: ", 1)[-1]) from None
        if len(self._source_ends):  # the joined index space holds the sources one after another
            source = int(torch.searchsorted(self._source_ends, batch["index"][:1], right=True)[0])
            self.step_source = self.source_names[source]
        if self.served is not None:
            self.served += 1
        return self.bad_samples.update(batch)

    @property
    def loader_step(self) -> int:
        """The samples one batch of every rank take together (G): local batch x data-parallel ranks."""
        return self.sampler.local_batch_size * self.sampler.world_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            **({} if self.served is None else {"position": self.served * self.loader_step}),
            "dataloader": self.dataloader.state_dict(),
            "bad_samples": self.bad_samples.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from `state_dict()`; the next batch is the one that followed it."""
        position = state_dict.get("position")
        self._set_epoch(state_dict["epoch"], None if position is None else position // self.loader_step)
        self.dataloader.load_state_dict(state_dict["dataloader"])
        self.bad_samples.load_state_dict(state_dict.get("bad_samples", {}))
        self._iterator = None

    def load_resharded(self, states: list[dict[str, Any]], dp_rank: int) -> None:
        """Continue the states every rank of a run with another number of data-parallel ranks saved (`states[r]`
        is its rank r's): the next batches of all ranks together are those that run's would have been, since an
        epoch's order does not depend on the split (`BlockedDistributedSampler`). ValueError where the saved
        position is not a whole number of this run's loader steps (a global batch changed since), or a state
        predates positions. This rank's skipped-sample counts: rank 0 takes the saved ranks' together."""
        if any("position" not in state for state in states):
            raise ValueError("its data loader states predate resuming on another number of ranks")
        epoch, position = states[0]["epoch"], states[0]["position"]
        if any((state["epoch"], state["position"]) != (epoch, position) for state in states):
            raise ValueError(f"its ranks' data loaders stopped at different places: {[s['position'] for s in states]}")
        if position % self.loader_step:
            raise ValueError(
                f"it stopped {position} samples into epoch {epoch}, not a whole number of this run's loader steps of "
                f"{self.loader_step} samples (local batch x data-parallel ranks)"
            )
        self._set_epoch(epoch, position // self.loader_step)
        self.sampler.load_state_dict({"epoch": epoch, "yielded": position // self.sampler.world_size})
        counts: Counter[str] = Counter()
        for state in states if dp_rank == 0 else ():
            counts.update(state["bad_samples"].get("counts", {}))
        seen = sum(s["bad_samples"].get("seen", 0) for s in states) if dp_rank == 0 else 0
        self.bad_samples.load_state_dict({"counts": dict(counts), "seen": seen})
        self._iterator = None

    def end_workers(self) -> None:
        """End the worker processes now, as the loader ends them after an epoch's last batch; the next batch
        starts new ones where these left off (the loader's state, as a resume restores it). The trainer calls it
        when its loop ends: the workers hold prefetched batches, and a process whose loader still holds them when
        it is torn down (a Trainer built in a notebook or a test) can wait on them forever, since they ignore
        SIGTERM (`leave_stop_signals_to_the_trainer`)."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)  # none with num_workers = 0
        if shutdown is None:
            return
        state = self.state_dict()
        shutdown()
        self.load_state_dict(state)


def started(loader: Iterable[T]) -> Iterator[T]:
    """`iter(loader)`, its worker processes forked while this process's objects are frozen (`gc.freeze`, as Python's
    documentation advises before a fork): a worker's garbage collections leave them alone, and the memory pages they
    sit on stay shared with this process instead of becoming each worker's copy. Unfrozen again once forked."""
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


MAX_PREFETCH = 8
"""Batches each worker keeps ready at most: a step of thousands of microbatches would otherwise hold a
second step's worth of host memory beside the one the trainer collects."""


def start_worker(worker_id: int) -> None:
    """A data worker's `worker_init_fn`: `leave_stop_signals_to_the_trainer`, then `return_freed_blocks`."""
    leave_stop_signals_to_the_trainer()
    return_freed_blocks()


def leave_stop_signals_to_the_trainer() -> None:
    """Ignore SIGTERM/SIGUSR1 in a data worker. Slurm (scancel, preemption, --signal) and `timeout` signal
    every process of the job, the workers too; a worker ended by one made the trainer fail with "DataLoader
    worker ... killed by signal" instead of finishing its step and saving (components/preemption.py). The
    loader still ends its workers, and a worker whose trainer died exits by itself (PyTorch's parent watchdog)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
WORKER_THRESHOLD = 128 * 1024
"""A data worker's allocation threshold and trim threshold, in bytes: glibc's starting values, kept fixed."""


def return_freed_blocks(worker_id: int = 0) -> None:
    """In a data worker (a `worker_init_fn` itself, as embed_images' workers take it), fix glibc's allocation and trim
    thresholds at `WORKER_THRESHOLD`: a decoded image or a batch on its way to shared memory gets its own mapping,
    returned to the system when freed, and the heap gives back a free top past that size. By default glibc raises
    the first threshold to each larger block freed (up to 32 MiB) and the second to twice it: later blocks of that
    size come from the heap, which gives freed memory back only from its top and only past twice the threshold.
    Where the C library is not glibc (macOS, musl), nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, WORKER_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, WORKER_THRESHOLD)


def build_dataloader(
    dataset: Dataset,
    *,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    num_workers: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    pin_memory: bool = False,
    max_bad_fraction: float = 0.001,
    step_samples: int = 0,
    same_source: bool = False,
    step_batches: int = 1,
) -> EpochLoader:
    """This rank's endless, resumable batch stream (an EpochLoader over a StatefulDataLoader).

    step_samples: an optimizer step's samples over all ranks (the global batch); epochs are cut into whole
    steps of them (`BlockedDistributedSampler`). 0: one loader step's, local_batch_size x dp_world_size.
    same_source: draw each step's samples from one of the dataset's `source_sizes` (`data.same_source_batches`).

    step_batches: the batches (microbatches) the trainer takes for one optimizer step; the workers keep
    that many ready (at least two each, PyTorch's default, at most MAX_PREFETCH each), so that they load
    the next step's batches while the current step computes: with fewer, a step of 64 microbatches waits
    for most of its data.

    max_bad_fraction: see `datasets.bad_samples` (sources that skip damaged records).
    pin_memory (for a CUDA run): page-locked batches, so the trainer's host-to-device copies are
    asynchronous and run at full PCIe speed."""
    if local_batch_size < 1 or dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise DataError(
            f"local_batch_size={local_batch_size}, dp_rank={dp_rank}, dp_world_size={dp_world_size}: "
            "need local_batch_size >= 1 and 0 <= dp_rank < dp_world_size"
        )
    if local_batch_size * dp_world_size > len(dataset):
        raise DataError(
            f"training.local_batch_size={local_batch_size} x dp_world_size={dp_world_size} = "
            f"{local_batch_size * dp_world_size} samples per step exceeds the {len(dataset)} samples of "
            f"{dataset.name}/{dataset.split}; use a local batch size of at most {len(dataset) // dp_world_size}"
        )
    step_samples = step_samples or local_batch_size * dp_world_size
    if step_samples > len(dataset):
        raise DataError(
            f"training.global_batch_size={step_samples} exceeds the {len(dataset)} samples of "
            f"{dataset.name}/{dataset.split}: one step would use samples twice; lower it or use more data"
        )
    sizes = list(getattr(dataset, "source_sizes", None) or ()) if same_source else []
    if same_source and len(sizes) < 2:
        raise DataError(
            f"data.same_source_batches=true: {dataset.name}/{dataset.split} is one source; join several with '::' in "
            "data.path (csv, webdataset, hf, pairs or vl_pairs data), or set data.same_source_batches=false"
        )
    small = [(i, size) for i, size in enumerate(sizes) if size < step_samples]
    if small:
        i, size = small[0]
        raise DataError(
            f"data.same_source_batches=true: source {i + 1} of data.path gives {size} samples per epoch, fewer than "
            f"the {step_samples} of one step (training.global_batch_size); raise its data.upsampling_factors, "
            "lower the global batch, or leave it out"
        )
    sampler = BlockedDistributedSampler(
        len(dataset),
        local_batch_size=local_batch_size,
        rank=dp_rank,
        world_size=dp_world_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
        source_sizes=sizes,
        step_samples=step_samples,
    )
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in recent torch; harmless
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        dataloader = StatefulDataLoader(
            dataset,
            batch_size=local_batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=passthrough_collate,
            drop_last=drop_last,
            persistent_workers=False,
            pin_memory=pin_memory,
            prefetch_factor=max(2, min(-(-step_batches // num_workers), MAX_PREFETCH)) if num_workers else None,
            worker_init_fn=start_worker,
            # its own generator: creating iterators must not draw from the global RNG, or a resumed
            # run (which creates one iterator fewer) would see different dropout/init randomness
            generator=torch.Generator(),
        )
    bad_samples = BadSampleLog(max_bad_fraction, len(sampler), shard_losses=getattr(dataset, "shard_losses", ()))
    return EpochLoader(dataloader, sampler, dataset, bad_samples)
