"""TorchState: a model, an optimizer, samplers and any other attributes, handed together to every worker of a new
world (and, in roll-back mode, committed and restored together).

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

Lossless mode (the default): the state counts each optimizer's completed steps (its step(), wrapped) and checks
for added or removed workers at step boundaries (after each step; the model's forward pre-hook raises what it
decided); sync() hands the live parameters, optimizer state, samplers and attributes of the rank
that completed the most steps to the rest. Nothing is copied per step. Roll-back mode (Horovod's): commit() keeps
deep copies of the model's and optimizer's state_dict (and the samplers' state) in memory; restore() loads them back
(bit for bit); sync() broadcasts rank 0's state and commits it.

A sharded optimizer (DistributedOptimizer(..., shard="optimizer" or "gradients")) works in lossless mode: each
rank's shard is also kept, updated every step, on its ring neighbour, and a new world rebuilds its shards from the
survivors' (ringtrain/torch/elastic_shards.py). Roll-back mode refuses it (no rank has a whole state to copy).
"""
import copy
import functools

import torch

from ..core import collectives
from ..elastic.sampler import ElasticSampler
from ..elastic.state import ObjectState
from ..errors import HorovodInternalError
from .elastic_shards import ShardBackup, is_sharded


class _ModelHandler:
    def __init__(self, model, state):
        self.value = model
        self.save()
        model.register_forward_pre_hook(lambda module, args: state.step_begins())

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self, root):
        from .broadcast import broadcast_parameters
        broadcast_parameters(self.value.state_dict(), root_rank=root)

    def reset(self):
        pass


class _OptimizerHandler(_ModelHandler):
    def __init__(self, optimizer, state):
        self.value = optimizer
        self.steps = 0                  # optimizer steps completed (travels with the state in sync)
        self.save()
        # the instance's step, wrapped: torch's step post-hooks run twice per step once load_state_dict() has
        # patched a DistributedOptimizer's class (its step calls the wrapped class's, each patched)
        inner = optimizer.step

        @functools.wraps(inner)
        def step(*args, **kwargs):
            result = self.call_step(inner, args, kwargs)
            self.steps += 1
            state.step_done()
            return result
        optimizer.step = step

    @staticmethod
    def call_step(inner, args, kwargs):
        return inner(*args, **kwargs)

    def sync(self, root):
        from .broadcast import broadcast_optimizer_state
        broadcast_optimizer_state(self.value, root_rank=root)

    def reset(self):
        # a DistributedOptimizer's buckets start over in a new world, where some ranks have never stepped
        hooks = getattr(self.value, "_ringtrain", None)
        if hooks is not None and hasattr(hooks, "restart"):
            hooks.restart()


class _ShardedOptimizerHandler(_OptimizerHandler):
    """A sharded optimizer (DistributedOptimizer(..., shard=...)): its shards and their copies on the ring
    neighbours (ShardBackup) are what a new world rebuilds its shards from; lossless mode only."""

    def __init__(self, optimizer, state):
        self.backup = ShardBackup(optimizer)
        self.state = state
        super().__init__(optimizer, state)

    def call_step(self, inner, args, kwargs):
        if self.backup.held is not None:       # a new world that skipped sync (workers only left)
            self.backup.restore(None, self.steps)
        before = self.backup.updates
        try:
            return inner(*args, **kwargs)
        except HorovodInternalError as error:
            if self.backup.updates == before:
                raise
            # the shard and its copy were updated; only the parameter allgather failed: the step is done here,
            # and the error waits for the next step boundary (the new world rebuilds the parameters from shards)
            self.state.hold(error)
            return None

    def save(self):
        if getattr(self.state, "rollback", False):
            raise ValueError("roll-back mode (run(rollback=True)) keeps whole copies of the optimizer state, which a "
                             "sharded optimizer (DistributedOptimizer(..., shard=...)) does not have on any rank: use "
                             "the default lossless mode")

    def restore(self):
        self.save()

    def sync(self, root):
        self.backup.restore(root, self.steps)

    def reset(self):
        self.backup.world_changed()


class _SamplerHandler(_ModelHandler):
    def __init__(self, sampler, state):
        self.value = sampler
        self.save()

    def sync(self, root):
        # the source rank's record, as its model and optimizer: only one rank's record matches the parameters
        # everyone takes (the samples of a step that completed nowhere are then dealt again)
        self.value.load_state_dict(collectives.broadcast_object(self.value.state_dict(), root_rank=root))

    def reset(self):
        self.value.reset()


def _handler_for(value, state):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value, state)
    if isinstance(value, torch.optim.Optimizer):
        return (_ShardedOptimizerHandler if is_sharded(value) else _OptimizerHandler)(value, state)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value, state)
    return None


class TorchState(ObjectState):
    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: _handler_for(value, self) for name, value in kwargs.items()}
        handlers = {name: handler for name, handler in handlers.items() if handler is not None}
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handlers})

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:        # a new model/optimizer object replaces the one committed
            handlers[name] = _handler_for(value, self) or handlers[name]
        super().__setattr__(name, value)

    def steps_completed(self):
        return sum(h.steps for h in self._handlers.values() if isinstance(h, _OptimizerHandler))

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync_from(self, root):
        for handler in self._handlers.values():
            handler.sync(root)
        counters = {name: h for name, h in self._handlers.items() if isinstance(h, _OptimizerHandler)}
        steps = collectives.broadcast_object({name: h.steps for name, h in counters.items()}, root_rank=root)
        for name, handler in counters.items():
            handler.steps = steps[name]
        super().sync_from(root)

    def sync(self):
        super().sync()
        if self.rollback:
            self.save()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
