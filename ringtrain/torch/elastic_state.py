"""TorchState: a model, an optimizer, samplers and any other attributes, committed and restored together.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

commit() keeps deep copies of the model's and optimizer's state_dict (and the samplers' state) in memory;
restore() loads them back (bit for bit); sync() broadcasts rank 0's parameters, optimizer state and the rest to
every rank, and commits the result so a later roll-back lands on the synced state.
"""
import copy

import torch

from ..core import collectives
from ..core import state as core_state
from ..elastic.sampler import ElasticSampler
from ..elastic.state import ObjectState


class _ModelHandler:
    def __init__(self, model):
        self.value = model
        self.save()

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        from .broadcast import broadcast_parameters
        broadcast_parameters(self.value.state_dict(), root_rank=0)

    def reset(self):
        pass


class _OptimizerHandler(_ModelHandler):
    def sync(self):
        from .broadcast import broadcast_optimizer_state
        broadcast_optimizer_state(self.value, root_rank=0)


    def reset(self):
        # a DistributedOptimizer's buckets start over in a new world, where some ranks have never stepped
        hooks = getattr(self.value, "_ringtrain", None)
        if hooks is not None and hasattr(hooks, "restart"):
            hooks.restart()


class _SamplerHandler(_ModelHandler):
    def sync(self):
        # rank 0's record, as its model and optimizer: after a roll-back the survivors may hold different commits
        # (one saved a commit whose collective check then failed, another failed a step earlier), and only one
        # rank's record matches the parameters everyone takes
        self.value.load_state_dict(collectives.broadcast_object(self.value.state_dict(), root_rank=0))

    def reset(self):
        self.value.reset()


def _handler_for(value):
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: _handler_for(value) for name, value in kwargs.items()}
        handlers = {name: handler for name, handler in handlers.items() if handler is not None}
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handlers})

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:        # a new model/optimizer object replaces the one committed
            handlers[name] = _handler_for(value) or handlers[name]
        super().__setattr__(name, value)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        if core_state.is_initialized():
            for handler in self._handlers.values():
                handler.sync()
            super().sync()
        self.save()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
