"""The wrapper classes of the bindings: `DistributedOptimizer(opt)` and `DistributedGradientTape(tape)` return an
instance of the user's own class (isinstance keeps working) with a mixin in front that hooks the few methods the
binding changes. One class per (mixin, user class), made once.

    cls = wrapper_class(_DistributedOptimizerMixin, type(optimizer))
    wrapped = adopt(cls, optimizer)      # same __dict__: same param_groups, state, hooks
"""
_classes = {}


def wrapper_class(mixin, base):
    """type(base.__name__, (mixin, base), {}), cached; raises ValueError when base already has the mixin."""
    if issubclass(base, mixin):
        raise ValueError(f"this {base.__name__} is already wrapped ({mixin.__name__.strip('_')})")
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = _classes[(mixin, base)] = type(base.__name__, (mixin, base), {})
    return cls


def adopt(cls, instance):
    """An instance of cls sharing instance's attributes (not a copy of them): the wrapper IS the user's object."""
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(instance.__dict__)
    return wrapped
