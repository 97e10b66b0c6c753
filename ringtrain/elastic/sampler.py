"""ElasticSampler: each sample once per epoch, across any number of changes of the world.

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    for batch_idx, batch in enumerate(loader):
        ...step...
        sampler.record_batch(batch_idx, B)        # then state.commit() now and then
    sampler.set_epoch(epoch + 1)

The epoch's order is one permutation (seed + epoch) of the samples not yet processed; rank r of n takes every n-th
of them, starting at r. record_batch(i, B) records batch i of EVERY rank, not only this one's: the step that trained
it was a collective, so each rank knows what all ranks consumed, and the record stays right when a rank dies with
its part of it. The state is then the same on every rank, so after a resize (reset: the new rank and size) the
remaining samples are re-dealt with nothing served twice or skipped. Unlike Horovod's sampler there is no padding:
shards differ by at most one sample, so a rank may have one batch fewer, or a smaller last batch, than another
(`steps(B)` is the batch count of the largest shard, the same on every rank; pad with empty batches, or join()).
"""
import math
import random

from ..core import state as core_state


class ElasticSampler:
    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    # ---- Horovod's interface ---------------------------------------------------------------------------------
    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Mark batch `batch_idx` (of `batch_size` samples per rank) of every rank as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size, all_ranks=True))

    def record_indices(self, indices):
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx, batch_size, all_ranks=False):
        """This rank's samples of batch `batch_idx` (with all_ranks, every rank's)."""
        start = batch_idx * batch_size
        shards = self._shards() if all_ranks else [self.indices]
        return [i for shard in shards for i in shard[start:start + batch_size]]

    def state_dict(self):
        return dict(epoch=self.epoch, processed_indices=set(self.processed_indices))

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Deal the epoch's unprocessed samples over the current world (called again after every resize)."""
        self.rank, self.num_replicas = ((core_state.rank(), core_state.size()) if core_state.is_initialized()
                                        else (0, 1))
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.indices = remaining[self.rank::self.num_replicas]
        self.num_samples = len(self.indices)

    def steps(self, batch_size):
        """Batches in the largest shard this epoch: the step count every rank can agree on."""
        return math.ceil(math.ceil(len(self.remaining_indices) / self.num_replicas) / batch_size)

    def _shards(self):
        return [self.remaining_indices[r::self.num_replicas] for r in range(self.num_replicas)]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
