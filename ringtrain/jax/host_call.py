"""The one mechanism every ringtrain.jax collective is built on: a JAX primitive computed on the host.

    prim = collective_primitive("ringtrain_allreduce", run, out_avals)
    prim.bind(x, y, spec=spec)      # -> [results], eagerly or inside jax.jit

Eagerly, `run(*numpy_views, spec=spec)` is called on zero-copy numpy views of the inputs (DLPack) and its numpy
results come back as jax.Arrays (zero-copy when 64-byte aligned).

Under jit on CPU the primitive lowers to one XLA FFI custom call (ffi_target.py, csrc/xla_host_call.cc) that hands
XLA's input and output buffers to Python as numpy views: `run_into(inputs, outputs, spec)` writes the results
straight into XLA's output buffers (the default run_into copies `run`'s results there). Where that handler cannot
be built (no C++ compiler; RINGTRAIN_JAX_LOWERING=callback), and on other platforms, the primitive lowers to JAX's
Python host callback instead, which calls `run` and copies its results into XLA's buffers.

Measured on a 2-core machine (benchmarks/results/jax_scaling_cpu_2ranks_abba_1.txt, DistributedOptimizer on a 3.7 MB
MLP): 1 rank 530 steps/s through the FFI custom call (outputs aliased to the inputs) against 376 through JAX's host
callback; 2 ranks 269 against 248. Why not `jax.experimental.io_callback`: it
first `device_put`s every input back into a jax.Array before calling Python; a chain of ten collectives in one jit
cost 3-4x more through io_callback than through JAX's host callback.

Ordering. Every collective blocks its thread until all ranks of its process set have called it, so two ranks that
ran the same two collectives in different orders would wait for each other forever. The primitive carries an
*ordered effect* (`CollectiveEffect`): JAX threads one token through every ringtrain collective of a computation,
in program order, and across successive jitted calls, so XLA can neither reorder them nor run two at once, and
neither can dead-code elimination drop one whose result is unused. Both lowerings take and return the token.
(DistributedOptimizer's reduction is the one primitive made with ordered=False: see optimizer.py.)
"""
import functools

import jax
import numpy as np
from jax._src import effects
from jax._src.callback import emit_python_callback
from jax._src.core import abstract_token
from jax._src.interpreters import mlir
from jax.core import ShapedArray
from jax.extend.core import Primitive

from . import arrays, ffi_target


class CollectiveEffect(effects.Effect):
    """The ordered side effect of a ringtrain collective."""

    def __str__(self):
        return "RingtrainCollective"


COLLECTIVE = CollectiveEffect()
for _allowed in (effects.lowerable_effects, effects.ordered_effects, effects.control_flow_allowed_effects,
                 effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
    _allowed.add_type(CollectiveEffect)


def collective_primitive(name, run, out_avals, run_into=None, ordered=True, in_place=False):
    """A primitive whose outputs are `run(*inputs, spec=spec)` computed on the host. `out_avals(*avals, spec=spec)`
    gives the outputs' jax.core.ShapedArrays at trace time. `run_into(inputs, outputs, spec)`, if given, writes
    the results into `outputs` (XLA's buffers, under jit with the FFI lowering) instead. ordered=False: no JAX
    effect and no token -- the custom call is still never removed or merged by XLA (it has a side effect), but
    its place among other collectives of the same computation is XLA's schedule, not program order (see
    optimizer.py for the one primitive that uses it, and why). in_place=True (outputs shaped like the inputs): under
    the FFI lowering XLA's output buffers ARE the input buffers, so XLA allocates none per call (run_into then
    reads each input before it writes the output at the same place)."""
    primitive = Primitive(name)
    primitive.multiple_results = True
    run_into = run_into or copy_results(run)

    def impl(*inputs, spec):
        return [arrays.to_jax(r) for r in run(*[arrays.to_numpy(x) for x in inputs], spec=spec)]

    def abstract_eval(*avals, spec):
        return out_avals(*avals, spec=spec), ({COLLECTIVE} if ordered else set())

    def lower(ctx, *operands, spec):
        if ffi_target.use_ffi(ctx.module_context.platforms[0]):
            return _lower_to_ffi(ctx, operands, run_into, spec, ordered, len(operands) if in_place else 0)

        def callback(*inputs):
            return tuple(run(*inputs, spec=spec))
        if not ordered:
            results, _, _ = emit_python_callback(ctx, callback, None, list(operands), ctx.avals_in, ctx.avals_out,
                                                 has_side_effect=True, returns_token=False)
            return results
        token = ctx.tokens_in.get(COLLECTIVE)
        results, token, _ = emit_python_callback(ctx, callback, token, list(operands), ctx.avals_in, ctx.avals_out,
                                                 has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COLLECTIVE: token})))
        return results

    primitive.def_impl(impl)
    primitive.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, lower, cacheable=False)
    return primitive


def _lower_to_ffi(ctx, operands, run_into, spec, ordered, in_place):
    """One FFI custom call, taking the ordering token as its last operand and returning it as its last result when
    the primitive is ordered."""
    call = ffi_target.register(run_into, spec, ctx.avals_in, ctx.avals_out)
    if not ordered:
        return ffi_target.lowering(ctx, *operands, call=call, in_place=in_place)
    with_token = ctx.replace(avals_in=(*ctx.avals_in, abstract_token), avals_out=(*ctx.avals_out, abstract_token))
    *results, token = ffi_target.lowering(with_token, *operands, ctx.tokens_in.get(COLLECTIVE), call=call,
                                          in_place=in_place)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COLLECTIVE: token})))
    return results


def copy_results(run):
    """run_into for a `run` that returns new arrays: copy each into its output buffer."""
    def run_into(inputs, outputs, spec):
        results = run(*inputs, spec=spec)
        if len(results) != len(outputs):
            raise RuntimeError(f"host collective returned {len(results)} arrays where {len(outputs)} were declared")
        for out, result in zip(outputs, results):
            result = np.asarray(result)
            if result.shape != out.shape or result.dtype != out.dtype:
                raise RuntimeError(f"host collective returned {result.shape} {result.dtype} where "
                                   f"{out.shape} {out.dtype} was declared")
            np.copyto(out, result)
    return run_into


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
