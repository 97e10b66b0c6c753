"""The one mechanism every ringtrain.jax collective is built on: a JAX primitive computed on the host.

    prim = collective_primitive("ringtrain_allreduce", run, out_avals)
    prim.bind(x, y, spec=spec)      # -> [results], eagerly or inside jax.jit

Eagerly, `run(*numpy_views, spec=spec)` is called on zero-copy numpy views of the inputs (DLPack) and its numpy
results come back as jax.Arrays (zero-copy when 64-byte aligned). Under jit the primitive lowers to one XLA host
callback (JAX's FFI Python callback) that calls the same `run` on the XLA buffers -- again numpy views, no copy
in -- and XLA copies the results into its output buffers (a host callback cannot write them in place).

Why this and not `jax.experimental.io_callback`: io_callback first `device_put`s every input back into a jax.Array
before calling Python; on this machine a chain of ten collectives in one jit cost 3-4x more through io_callback
than through this lowering (benchmarks/jax_scaling.py measures the per-collective cost). Why not an XLA FFI custom
call: the collectives run in ringtrain's Python engine, so a compiled FFI handler would still have to take the GIL
and call Python -- which is exactly what JAX's own FFI Python callback does, without a C++ build.

Ordering. Every collective blocks its thread until all ranks of its process set have called it, so two ranks that
ran the same two collectives in different orders would wait for each other forever. The primitive carries an
*ordered effect* (`CollectiveEffect`): JAX threads one token through every ringtrain collective of a computation,
in program order, and across successive jitted calls, so XLA can neither reorder them nor run two at once, and
neither can dead-code elimination drop one whose result is unused.
"""
import functools

import jax
from jax._src import effects
from jax._src.callback import emit_python_callback
from jax._src.interpreters import mlir
from jax.core import ShapedArray
from jax.extend.core import Primitive

from . import arrays


class CollectiveEffect(effects.Effect):
    """The ordered side effect of a ringtrain collective."""

    def __str__(self):
        return "RingtrainCollective"


COLLECTIVE = CollectiveEffect()
for _allowed in (effects.lowerable_effects, effects.ordered_effects, effects.control_flow_allowed_effects,
                 effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
    _allowed.add_type(CollectiveEffect)


def collective_primitive(name, run, out_avals):
    """A primitive whose outputs are `run(*inputs, spec=spec)` computed on the host. `out_avals(*avals, spec=spec)`
    gives the outputs' jax.core.ShapedArrays at trace time."""
    primitive = Primitive(name)
    primitive.multiple_results = True

    def impl(*inputs, spec):
        return [arrays.to_jax(r) for r in run(*[arrays.to_numpy(x) for x in inputs], spec=spec)]

    def abstract_eval(*avals, spec):
        return out_avals(*avals, spec=spec), {COLLECTIVE}

    def lower(ctx, *operands, spec):
        def callback(*inputs):
            return tuple(run(*inputs, spec=spec))
        token = ctx.tokens_in.get(COLLECTIVE)
        results, token, _ = emit_python_callback(ctx, callback, token, list(operands), ctx.avals_in, ctx.avals_out,
                                                 has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COLLECTIVE: token})))
        return results

    primitive.def_impl(impl)
    primitive.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, lower, cacheable=False)
    return primitive


def same_avals(*avals, spec):
    """out_avals of a collective whose outputs are shaped like its inputs."""
    return [ShapedArray(a.shape, a.dtype) for a in avals]


def differentiable(primitive, backward, residual=None):
    """collective(arrays, spec) -> tuple: the primitive as a jax.custom_vjp function whose backward pass is
    backward(spec, residual(arrays), cotangents) -> tuple of the inputs' cotangents (each module's gradient rule)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def collective(arrays, spec):
        return tuple(primitive.bind(*arrays, spec=spec))

    def forward(arrays, spec):
        return collective(arrays, spec), (residual(arrays) if residual is not None else None)

    def backward_pass(spec, saved, cotangents):
        return (backward(spec, saved, cotangents),)

    collective.defvjp(forward, backward_pass)
    return collective
