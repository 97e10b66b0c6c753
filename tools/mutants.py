#!/usr/bin/env python
"""Plant plausible bugs one at a time and check that the tests catch each one.

    python tools/mutants.py                 # every mutant (a few minutes on a quiet 2-core machine)
    python tools/mutants.py -k shm          # those whose name contains "shm"
    python tools/mutants.py --list          # what would run
    python tools/mutants.py --sample 3 --seed abc123 --budget 100   # CI: a few, chosen from the commit

For each mutant: copy the repository to a temporary directory, replace one exact piece of text in one file, run the
mutant's tests there (single-process pytest or an mpiexec job of tests/parallel files, with PYTHONPATH pointing at the
copy) and call it CAUGHT when a test fails. The working tree is never touched.

Exit status is non-zero when a mutant SURVIVED (no test failed), is STALE (its text is not in the file exactly once:
the code moved on, so update the mutant to plant the same bug in the new code) or INVALID (the mutated file does not
compile), or when the tests already fail without any mutant (BASELINE). Run it whenever the engine, a transport or
the optimizer changed. CI runs the cheap part: tests/test_mutants.py checks that every target is planted exactly once
(a stale mutant fails CI) and runs a small sample chosen from the commit (`--sample`), so every commit checks a few
and the whole table rotates through CI over time.
"""
import argparse
import dataclasses
import hashlib
import os
import py_compile
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT_S = 300
KILLED = "(killed after %d s)"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", "*.pyc", "build", "dist", "*.egg-info",
                                     ".pytest_cache", "results")


@dataclasses.dataclass(frozen=True)
class Tests:
    """pytest over `paths` (with `-k select`): one process when ranks == 0, else `mpiexec -n ranks`."""
    paths: tuple
    ranks: int = 0
    select: str = ""
    env: tuple = ()    # extra (name, value) pairs, e.g. (("RINGTRAIN_SIMULATE_NODES", "2"),)

    def describe(self):
        where = "".join(f"{k}={v} " for k, v in self.env) + (f"mpiexec -n {self.ranks} " if self.ranks else "")
        return where + " ".join(p.replace("tests/", "") for p in self.paths) + (f" -k '{self.select}'"
                                                                                if self.select else "")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str          # file relative to the repository root
    old: str           # must occur exactly once
    new: str
    tests: tuple       # of Tests; CAUGHT when any of them fails
    why: str = ""


FUSED = "tests/parallel/test_fused_allreduce.py"
ELASTIC = "tests/test_elastic.py"
ELASTIC_PIECES = "tests/test_elastic_pieces.py"
ELASTIC_LOSSLESS = "tests/test_elastic_lossless.py"
OPTIMIZER_REFERENCE = "tests/parallel/test_optimizer_reference.py"
HIERARCHICAL = "tests/parallel/test_hierarchical.py"
EXPRESS = "tests/parallel/test_express.py"
GROUPED_EXPRESS = "tests/parallel/test_grouped_express.py"
JAX_GRADIENTS = "tests/parallel_jax/test_jax_gradients.py"
JAX_OPTIMIZER = "tests/parallel_jax/test_jax_optimizer.py"
CHURN = "tests/parallel/test_name_churn.py"
SOAK = "tests/parallel/test_soak.py"
API_FORMS = "tests/parallel/test_api_forms.py"
OBSERVE = "tests/parallel/test_observability.py"
OBSERVE_JOBS = "tests/test_observability.py"
SHARDED = "tests/parallel/test_sharded_optimizer.py"
ADASUM = "tests/parallel/test_adasum.py"
NATIVE_CYCLE = "tests/test_native_cycle.py"
NATIVE_CYCLE_JOB = "tests/parallel/test_native_cycle.py"

BENCHMARKS = "tests/test_benchmarks.py"
IMPORT_GRAPH = "tests/test_import_graph.py"

MUTANTS = [
    Mutant("shm_reduce_skips_a_peer", "ringtrain/transports/shm.py",
           "sources = [region(q, r, bases[q]) for q in peers]",
           "sources = [region(q, r, bases[q]) for q in peers[1:]]",
           (Tests((FUSED,), ranks=3, select="shm and grouped and large"),),
           "each rank reduces its block from all peers but one (and does not push to it)"),
    Mutant("shm_small_reduce_skips_a_peer", "ringtrain/ops.py",
           "for array in arrays[2:]:",
           "for array in arrays[3:]:",
           (Tests((FUSED,), ranks=3, select="shm and grouped and small"),),
           "the one-barrier path for small allreduces leaves out the third rank's contribution"),
    Mutant("flag_barrier_waits_one_sync_behind", "ringtrain/transports/flag_barrier.py",
           "lambda p: seqs[p] >= target,",
           "lambda p: seqs[p] >= target - 1,",
           (Tests(("tests/parallel/test_flag_barrier.py",), ranks=3),
            Tests((FUSED,), ranks=3, select="shm and grouped and large")),
           "a barrier that lets a rank through when its peers reached only the previous sync (shm, cuda_ipc)"),
    Mutant("flag_barrier_blames_unchecked_ranks", "ringtrain/engine/watchdog.py",
           "return sorted(p for p in waiting if not arrived(p))",
           "return sorted(waiting)",
           (Tests(("tests/parallel/test_flag_barrier.py",), ranks=3, select="never_arrives"),),
           "a stall names ranks that did arrive (the poll stops at the first missing one)"),
    Mutant("aligned_view_ignores_the_address", "ringtrain/aligned.py",
           '    start = -raw.__array_interface__["data"][0] % alignment\n', "    start = 0\n",
           (Tests(("tests/test_result_pool.py",), select="align"),),
           "a result meant for TF or XLA starts where np.empty put it (16-byte aligned): they copy it, or TF aborts"),
    Mutant("slab_hands_out_bytes_twice", "ringtrain/aligned.py",
           "self._next = start + (nbytes // self._alignment + 1) * self._alignment",
           "self._next = start + (nbytes // self._alignment) * self._alignment",
           (Tests(("tests/test_result_pool.py",), select="slab"),),
           "two small eager TF/JAX results share bytes: writing one (or a later call's result) changes the other"),
    Mutant("to_jax_skips_the_dtype_canonicalisation", "ringtrain/jax/arrays.py",
           "if not array.flags.c_contiguous or jax.dtypes.canonicalize_dtype(array.dtype) != array.dtype:",
           "if not array.flags.c_contiguous:",
           (Tests(("tests/test_jax_host_call.py",), select="jnp_asarray"),),
           "a float64 result becomes a float64 jax.Array with x64 off (jnp.asarray makes float32)"),
    Mutant("tf_size_op_ignores_the_process_set", "ringtrain/tensorflow/topology_ops.py",
           "tf.constant(_process_set(process_set_id).size(),", "tf.constant(_process_set(0).size(),",
           (Tests(("tests/parallel_tf/test_tf_horovod_api.py",), ranks=2, select="size_op_of_a_process_set"),),
           "hvd.size_op(process_set_id=...) gives the world's size instead of the set's"),
    Mutant("jax_eager_checks_nothing", "ringtrain/jax/allreduce.py",
           "    if (wire.dtype, op) not in _REDUCIBLE:", "    if False:",
           (Tests(("tests/parallel_jax/test_jax_collectives.py",), ranks=2, select="every_dtype_and_op and eager"),),
           "an eager Max of complex arrays is not refused with UnsupportedDtypeError (the pair memo never checks)"),
    Mutant("result_pool_reuses_a_held_result", "ringtrain/engine/result_pool.py",
           "return [b if n <= _ALONE else None for b, n in zip(blocks, _counts(blocks))]",
           "return [b if n <= _ALONE + 1 else None for b, n in zip(blocks, _counts(blocks))]",
           (Tests(("tests/test_result_pool.py",)),),
           "a large result is handed out again while the caller (or a view of it) still holds it"),
    Mutant("tf_eager_path_sums_instead_of_averaging", "ringtrain/tensorflow/functions.py",
           "result = collectives.allreduce(array, op=op, name=name,",
           "result = collectives.allreduce(array, op=Sum, name=name,",
           (Tests(("tests/parallel_tf/test_tf_eager_path.py",), ranks=2),),
           "TF eager's direct core call drops the Average scale (the sum comes back)"),
    Mutant("tf_eager_path_ignores_the_tape", "ringtrain/tensorflow/functions.py",
           "if type(tensor) is _EAGER_TENSOR and tf.executing_eagerly() and not record.could_possibly_record():",
           "if type(tensor) is _EAGER_TENSOR and tf.executing_eagerly():",
           (Tests(("tests/parallel_tf/test_tf_eager_path.py",), ranks=2, select="tape"),),
           "an eager allreduce under a GradientTape skips custom_gradient: no gradient flows through it"),
    Mutant("jax_eager_path_drops_the_prescale", "ringtrain/jax/allreduce.py",
           "result = collectives.allreduce(w.array, w.op, name, float(prescale_factor),",
           "result = collectives.allreduce(w.array, w.op, name, 1.0,",
           (Tests(("tests/parallel_jax/test_jax_eager_path.py",), ranks=2),),
           "JAX eager's direct core call forgets prescale_factor"),
    Mutant("shm_chunk_split_drops_remainders", "ringtrain/transports/shm.py",
           "steps = [-(-c // k) for c in counts]",
           "steps = [c // k for c in counts]",
           (Tests((FUSED,), ranks=2, select="shm and grouped and large"),),
           "an input larger than the shared region loses the last elements of every block"),
    Mutant("shm_reads_every_region_packed", "ringtrain/transports/shm.py",
           "lo = packed[p] * itemsize if base == _PRIVATE else base + chunk[p][0] * itemsize",
           "lo = packed[p] * itemsize",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="region"),),
           "a peer whose buffer lies in the region is read at its region's start, where private copy-ins go"),
    Mutant("shm_in_region_rank_ignores_private_peers", "ringtrain/transports/shm.py",
           "if in_region is not None and _PRIVATE in bases:",
           "if in_region is not None and _PRIVATE == bases[r]:",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="cache_sized_chunks"),),
           "a rank whose buffer lies in the region runs one chunk while its private peers run several"),
    Mutant("shm_region_result_reads_its_own_block_from_out", "ringtrain/transports/shm.py",
           "own, result = mine(r, own_input), mine(r, out)",
           "own, result = mine(r), mine(r, out)",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="into_the_region"),),
           "allreduce_out into a buffer of the region reduces this rank's block from the result buffer, not src"),
    Mutant("shm_region_result_skips_the_copy_in", "ringtrain/transports/shm.py",
           "                    fill(out[starts[p]: starts[p] + counts[p]], buf[starts[p]: starts[p] + counts[p]])\n",
           "                    pass\n",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="into_the_region"),
            Tests(("tests/parallel/test_grouped_express.py",), ranks=2, select="bucket_of_the_window")),
           "allreduce_out into a buffer of the region never copies the blocks peers read into it"),
    Mutant("shm_segments_outs_out_of_order_taken_as_one_run", "ringtrain/transports/shm.py",
           "        if not self._in_region(begin, segments.nbytes) or any(",
           "        if not self._in_region(begin, segments.nbytes) or not any(",
           (Tests(("tests/parallel/test_grouped_express.py",), ranks=2, select="bucket_of_the_window"),),
           "outs in the window in another order than the arrays are taken for one run of the region"),
    Mutant("shm_signature_in_one_place", "ringtrain/transports/shm.py",
           "return 2 + _SIGNATURE_WORDS * (sync % 2)",
           "return 2",
           (Tests(("tests/parallel/test_transports.py",), ranks=3, select="large_collectives_that_disagree"),),
           "a rank that raised on a mismatch publishes its next signature over the one a slower peer has not read: "
           "that peer reduces as if all agreed and the ranks fall out of step"),
    Mutant("shm_signature_check_reads_its_own_line", "ringtrain/transports/shm.py",
           "for i in range(_SIGNATURE_WORDS)] for p in range(self.size)]",
           "for i in range(_SIGNATURE_WORDS)] for p in [self.rank]]",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="large_collectives_that_disagree"),),
           "ranks running different large collectives reduce each other's buffers without a word"),
    Mutant("shm_region_offset_remembered_for_any_buffer", "ringtrain/transports/shm.py",
           "if buf is last:",
           "if last is not None:",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="large_collectives_that_disagree"),),
           "the offset of the last buffer reduced in the region is taken for another buffer"),
    Mutant("optimizer_unbucketed_parameters_never_looked_up_again", "ringtrain/torch/gradient_hooks.py",
           "if len(seen) != len(groups) or any(params is not",
           "if not seen or any(params is not",
           (Tests(("tests/test_torch_binding.py",), select="zero_grad_clears"),),
           "zero_grad() leaves the gradients of parameters added to the optimizer after its first zero_grad"),
    Mutant("optimizer_first_step_hooks_the_parameters", "ringtrain/torch/gradient_hooks.py",
           "first_step = not reducer.overlap and self.counted is None and self.node_hooks_first_step",
           "first_step = False",
           (Tests(("tests/test_torch_binding.py",), select="one_parameter_per_bucket"),),
           "after backward, step 1 hooks every parameter: the removed hooks cost ~0.6 us per parameter per backward"),
    Mutant("optimizer_first_step_accumulators_not_held", "ringtrain/torch/gradient_hooks.py",
           "                    accumulators.append(accumulator)\n",
           "",
           (Tests(("tests/test_torch_binding.py",), select="one_parameter_per_bucket"),),
           "the gradient accumulators hooked for step 1 die before its forward, which makes new ones: nothing counts"),
    Mutant("shm_reducescatter_out_reduces_into_src", "ringtrain/transports/shm.py",
           "self._collective(src, counts, op, reduce=True, gather=False, kind=2, out=dst)",
           "self._collective(src, counts, op, reduce=True, gather=False, kind=2, out=src)",
           (Tests((HIERARCHICAL,), ranks=4, select="reducescatter_out or allreduce_out"),),
           "the hierarchy's first step overwrites the caller's input and leaves the output unreduced"),
    Mutant("shm_reducescatter_out_lone_rank_copies_nothing", "ringtrain/transports/shm.py",
           "elif self.size == 1 or self._offset_in_region(src)",
           "elif self._offset_in_region(src)",
           (Tests((HIERARCHICAL,), ranks=3, select="allreduce_out"),),
           "a rank alone on its node (2+1) starts its cross-node rings from garbage instead of its input"),
    Mutant("hierarchical_out_skips_the_cross_rings", "ringtrain/transports/hierarchical.py",
           "cross_allreduce(transport, dst[starts[block]: starts[block] + blocks[block]], op, scale)",
           "pass",
           (Tests((HIERARCHICAL,), ranks=4, select="allreduce_out"),),
           "each pretend node ends with its own sum, not the world's"),
    Mutant("hierarchical_cross_scales_a_peers_part", "ringtrain/transports/hierarchical.py",
           "start = offsets(counts)[transport.rank]",
           "start = offsets(counts)[(transport.rank + 1) % transport.size]",
           (Tests((HIERARCHICAL,), ranks=4, select="allreduce_out"),),
           "an averaged hierarchical allreduce scales the half another node finishes, before it is reduced"),
    Mutant("hierarchical_column_of_the_next_local_rank", "ringtrain/transports/hierarchical.py",
           "column = [buf[starts[k * g + j]: starts[k * g + j] + counts[k * g + j]] for k in range(len(self._nodes))]",
           "column = [buf[starts[k * g + (j + 1) % g]: starts[k * g + (j + 1) % g] + counts[k * g + (j + 1) % g]]"
           " for k in range(len(self._nodes))]",
           (Tests((HIERARCHICAL,), ranks=4, select="reducescatter_allgather_broadcast"),),
           "the cross-node step of allgather/reducescatter works on another local rank's blocks"),
    Mutant("pairwise_allgather_lands_at_the_wrong_block", "ringtrain/transports/pairwise.py",
           "receives = _segments(views[me] if op is not None else views[source], segment)",
           "receives = _segments(views[me] if op is not None else views[to], segment)",
           (Tests((HIERARCHICAL,), ranks=3, select="reducescatter_allgather_broadcast"),),
           "with 3 nodes (1+1+1) a block received across nodes is stored where another node's belongs"),
    Mutant("ring_segments_off_by_one", "ringtrain/transports/ring.py",
           "return [(lo, min(lo + seg, count)) for lo in range(0, count, seg)]",
           "return [(lo, min(lo + seg - 1, count)) for lo in range(0, count, seg)]",
           (Tests(("tests/test_ring_schedule.py",)),),
           "every ring segment leaves out its last element"),
    Mutant("even_counts_off_by_one", "ringtrain/transports/base.py",
           "return [base + (1 if r < extra else 0) for r in range(size)]",
           "return [base + (1 if r <= extra else 0) for r in range(size)]",
           (Tests(("tests/test_ring_schedule.py",)), Tests((FUSED,), ranks=2, select="grouped")),
           "the blocks of an allreduce no longer add up to the buffer"),
    Mutant("fused_bucket_loses_the_scale", "ringtrain/engine/executor.py",
           "transport.allreduce_out(staging, staging, ReduceOp(meta.op), scale)",
           "transport.allreduce_out(staging, staging, ReduceOp(meta.op), 1.0)",
           (Tests((FUSED,), ranks=2, select="shm and grouped"),),
           "Average's 1/N (and postscale) never reach a fused bucket of several tensors"),
    Mutant("average_divides_by_size_minus_one", "ringtrain/ops.py",
           "return postscale / size if op == ReduceOp.AVERAGE else postscale",
           "return postscale / (size - 1) if op == ReduceOp.AVERAGE else postscale",
           (Tests((FUSED,), ranks=3, select="shm and grouped"),),
           "Average divides by one rank too few"),
    Mutant("optimizer_last_bucket_sums", "ringtrain/reducer/reducer.py",
           "kwargs = dict(op=self.scaling.op, name=bucket.name,",
           "kwargs = dict(op=Sum if 0 < bucket.index == len(self.buckets) - 1 else self.scaling.op, name=bucket.name,",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="several_small_buckets"),),
           "with more than one bucket, the last one is summed instead of averaged"),
    Mutant("optimizer_wrong_scale_for_one_bucket", "ringtrain/reducer/reducer.py",
           "process_set=self.process_set, **scales)",
           "process_set=self.process_set,"
           " **(dict(postscale_factor=0.5) if bucket.index == 1 else scales))",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="several_small_buckets and sgd"),),
           "the second bucket is halved"),
    Mutant("optimizer_trigger_ignores_the_passes", "ringtrain/reducer/reducer.py",
           "return (len(bucket.arrivals) == self.passes_per_step * len(bucket.members)",
           "return (len(bucket.arrivals) >= len(bucket.members)",
           (Tests(("tests/test_reducer.py",), select="pass_counting"),),
           "with backward_passes_per_step=2 a bucket goes out after the first pass"),
    Mutant("reducer_pass_counter_off_by_one", "ringtrain/reducer/reducer.py",
           "return (len(bucket.arrivals) == self.passes_per_step * len(bucket.members)",
           "return (len(bucket.arrivals) + 1 == self.passes_per_step * len(bucket.members)",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="only_after_its_last_gradient"),),
           "a bucket counts one arrival too many: it goes out while its last gradient is still being computed"),
    Mutant("reducer_replan_uses_each_ranks_own_order", "ringtrain/reducer/reducer.py",
           "chosen = [i for i in order.tolist() if i]",
           "chosen = [i for i in mine if i]",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="ready_orders_differ"),),
           "after the first step each rank re-lays its buckets in the order IT observed: where ranks observed "
           "different orders, the same bucket name holds different gradients on different ranks"),
    Mutant("reducer_predivide_applied_twice", "ringtrain/reducer/reducer.py",
           'scales["prescale_factor"] = self.prescale_factor',
           'scales["prescale_factor"] = self.prescale_factor ** 2',
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="predivide"),),
           "gradient_predivide_factor divides twice before the sum (and multiplies once after)"),
    Mutant("keras_predivide_applied_twice", "ringtrain/tensorflow/gradients.py",
           "reducer.submit(bucket, [buffer], sync=True, prescaled=True)",
           "reducer.submit(bucket, [buffer], sync=True, prescaled=False)",
           (Tests(("tests/parallel_tf/test_tf_training.py",), ranks=2, select="predivide"),),
           "keras's shared buffers are prescaled while packing and again by the core"),
    Mutant("tf_collective_op_holds_the_executor_thread", "ringtrain/tensorflow/host_op.py",
           "_waiters.put(lambda: _run(token, fn, out_dtypes, arrays))",
           "_run(token, fn, out_dtypes, arrays)",
           (Tests(("tests/parallel_tf/test_tf_collective_order.py",), ranks=2, select="v1_graph",
                  env=(("RINGTRAIN_STALL_TIMEOUT_S", "10"),)),),
           "the TF op runs its collective on TF's executor thread (synchronous again): independent collectives "
           "run in different orders on the ranks deadlock"),
    Mutant("tf_mismatch_is_unknown_error", "ringtrain/tensorflow/host_op.py",
           "return _FAILED_PRECONDITION, ",
           "return _UNKNOWN, ",
           (Tests(("tests/parallel_tf/test_tf_errors.py",), ranks=2, select="function"),),
           "a rank disagreement in a graph surfaces as UnknownError, not Horovod's FailedPreconditionError"),
    Mutant("reducescatter_integer_prescale_after_the_sum", "ringtrain/engine/executor.py",
           'if prescale != 1.0 and (dtype.kind in "iub" or dtype.itemsize == 2):',
           'if False:',
           (Tests(("tests/parallel/test_torch_horovod_rules.py",), ranks=3, select="reducescatter"),),
           "reducescatter scales integers after the sum (rounding once) instead of each rank's input (Horovod)"),
    Mutant("optimizer_outside_its_set_joins_the_model_check", "ringtrain/torch/optimizer.py",
           "if process_set.included() is False:",
           "if False:",
           (Tests(("tests/parallel/test_torch_horovod_rules.py",), ranks=2, select="outside"),),
           "a DistributedOptimizer built on a rank outside its process set runs the set's model check"),
    Mutant("horovod_cycle_time_not_mapped", "ringtrain/config.py",
           '    "HOROVOD_CYCLE_TIME": ("cycle_time_ms", float),\n',
           "",
           (Tests(("tests/test_horovod_settings.py",), select="maps or init_warns"),),
           "a ported job's HOROVOD_CYCLE_TIME is silently ignored again"),
    Mutant("join_reports_the_lowest_joined_rank", "ringtrain/engine/negotiation.py",
           "last = max(self.joined, key=self.joined.get)",
           "last = min(self.joined)",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="join and after_backward"),),
           "join() returns the lowest rank that joined instead of the last one (unseen while rank 0 always joined "
           "last)"),
    Mutant("optimizer_state_broadcast_from_rank_0", "ringtrain/torch/broadcast.py",
           "_broadcast_tensors_inplace(list(_live_state_tensors(optimizer)), root_rank, process_set)",
           "_broadcast_tensors_inplace(list(_live_state_tensors(optimizer)), 0, process_set)",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="broadcast_optimizer_state"),),
           "broadcast_optimizer_state sends rank 0's state tensors whatever root_rank says"),
    Mutant("optimizer_ignores_op_sum", "ringtrain/reducer/reducer.py",
           "            return cls(op)\n",
           "            return cls(Average)\n",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="op_sum"),),
           "DistributedOptimizer(op=Sum) averages anyway"),
    Mutant("gradient_rule_reducescatter_sum_not_scaled", "ringtrain/reducer/gradient_rules.py",
           "return (set_size if op == Sum else 1) * prescale_factor * postscale_factor",
           "return prescale_factor * postscale_factor",
           (Tests(("tests/parallel/test_torch_autograd.py",), ranks=2, select="reducescatter"),
            Tests(("tests/parallel_tf/test_tf_collectives.py",), ranks=2, select="documented_rules")),
           "reducescatter's gradient for op=Sum is the bare allgather (Horovod multiplies by the set's size)"),
    Mutant("integer_average_floors", "ringtrain/ops.py",
           '    np.add(dst, round_up, out=dst, casting="unsafe")\n',
           "    pass\n",
           (Tests(("tests/parallel/test_torch_api.py",), ranks=2, select="integer_average"),),
           "integer Average rounds toward minus infinity (-75 / 2 = -38) instead of toward zero as Horovod"),
    Mutant("optimizer_flat_bucket_not_copied_back", "ringtrain/torch/gradient_hooks.py",
           "            p.grad = view\n        return buffer\n",
           "            pass\n        return buffer\n",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="hundreds_of_small_tensors_match and sgd"),),
           "the gradients are copied into the bucket but never become its views: the reduction never reaches .grad"),
    Mutant("optimizer_alone_tensor_skipped_after_backward", "ringtrain/reducer/reducer.py",
           "result = start(arrays[0], out=arrays[0] if outs is None else outs[0], **kwargs)",
           "result = (start if sync is False or len(bucket.members) > 1 else (lambda *a, **k: None))("
           "arrays[0], out=arrays[0] if outs is None else outs[0], **kwargs)",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="default_caps"),),
           "a large gradient travelling alone is not reduced after backward"),
    Mutant("optimizer_zero_grad_keeps_old_gradients", "ringtrain/torch/gradient_hooks.py",
           "bucket.buffer.zero_()",
           "pass",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="several_small_buckets and sgd"),),
           "gradients that are bucket views are not zeroed: the next step adds to the last one"),
    Mutant("optimizer_trusts_stale_views", "ringtrain/torch/gradient_hooks.py",
           "return (bucket.views is not None\n            and all(map(operator.is_, map(_GRAD, bucket.keys), bucket.views)))",
           "return bucket.views is not None",
           (Tests((OPTIMIZER_REFERENCE,), ranks=2, select="cleared_any_way"),),
           "after model.zero_grad() (or new .grad tensors) the stale bucket buffer is reduced"),
    Mutant("optimizer_refilled_gradients_never_cleared", "ringtrain/torch/gradient_hooks.py",
           "            if bucket.views is None or (set_to_none and self.refilled(bucket)):\n"
           "                others += bucket.keys\n                continue\n",
           "            if set_to_none and self.refilled(bucket):\n                continue\n"
           "            if bucket.views is None:\n                others += bucket.keys\n                continue\n",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="refilled"),),
           "zero_grad() neither drops nor zeroes the gradients of a refilled bucket: each step adds to the last"),
    Mutant("reducer_after_backward_large_gradients_alone", "ringtrain/reducer/buckets.py",
           "    large_alone = keep_order if large_alone is None else large_alone\n",
           "    large_alone = True if large_alone is None else large_alone\n",
           (Tests(("tests/test_torch_binding.py",), select="layout"),),
           "after backward every large gradient is again a bucket of its own (a cycle and two barriers each)"),
    Mutant("reducer_remaining_buckets_never_reversed", "ringtrain/reducer/reducer.py",
           "for bucket in (reversed(self.buckets) if last_ready_first else self.buckets):",
           "for bucket in self.buckets:",
           (Tests(("tests/test_torch_binding.py",), select="last_ready_bucket"),),
           "after backward step() reduces the buckets in bucket order, the coldest gradients first"),
    Mutant("reducer_large_buckets_ignore_their_cap", "ringtrain/reducer/buckets.py",
           "            cap = large_bucket_bytes or cap\n",
           "            cap = cap\n",
           (Tests(("tests/test_torch_binding.py",), select="layout or fusion_threshold"),),
           "after backward a bucket of large gradients is capped at bucket_bytes, not its own cap"),
    Mutant("optimizer_large_buckets_capped_at_bucket_cap_mb", "ringtrain/torch/gradient_hooks.py",
           "large_bucket_bytes=max(int(bucket_cap_mb * _MB), core_state.config().fusion_threshold),",
           "large_bucket_bytes=int(bucket_cap_mb * _MB),",
           (Tests(("tests/test_torch_binding.py",), select="fusion_threshold"),),
           "after backward large gradients share buckets only up to bucket_cap_mb (the convnet's 24 + 1.1 MB: two)"),
    Mutant("optimizer_reduces_into_the_fresh_gradient", "ringtrain/torch/gradient_hooks.py",
           "outs=[to_array(v) for v in views], sync=sync)",
           "outs=[to_array(g) for g in grads], sync=sync)",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="refilled"),),
           "a refilled bucket is reduced into the fresh gradients, not the bucket that .grad views"),
    Mutant("optimizer_refilled_bucket_keeps_the_fresh_gradients", "ringtrain/torch/gradient_hooks.py",
           "        for p, view in zip(bucket.keys, views):\n            p.grad = view\n",
           "",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="refilled"),),
           "a refilled bucket is reduced into its buffer but .grad stays the unreduced fresh gradient"),
    Mutant("optimizer_refilled_bucket_of_several_packed", "ringtrain/torch/gradient_hooks.py",
           "if grads and not sparse and self.refilled(bucket)",
           "if len(grads) == 1 and not sparse and self.refilled(bucket)",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2, select="several_gradients"),),
           "a refilled bucket of several gradients is packed by a copy again instead of reduced from them"),
    Mutant("optimizer_after_backward_hooks_no_parameter", "ringtrain/torch/gradient_hooks.py",
           "                if counted is not None and member.key is not counted:\n",
           "                if counted is not None:\n",
           (Tests(("tests/test_torch_binding.py",), select="one_parameter_per_bucket or too_many"),),
           "after backward, from the second step on no parameter of a bucket of several counts the passes"),
    Mutant("host_memory_thresholds_not_set", "ringtrain/host_memory.py",
           "if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold)):",
           "if False:",
           (Tests(("tests/test_host_memory.py",)),),
           "the thresholds are reported set but never are: every step's large gradient gets fresh pages again"),
    Mutant("optimizer_forgets_the_host_memory", "ringtrain/torch/gradient_hooks.py",
           "            host_memory.keep_freed_blocks(max(host), sum(host))",
           "            pass",
           (Tests(("tests/test_host_memory.py",)),),
           "wrapping a CPU model leaves glibc's thresholds as they were"),
    Mutant("sharded_stage_two_forgets_the_host_memory", "ringtrain/torch/sharded.py",
           "            host_memory.keep_freed_blocks(max(host), sum(host))",
           "            pass",
           (Tests(("tests/test_host_memory.py",), select="gradients"),),
           "shard='gradients' leaves glibc's thresholds as they were: every step's fresh gradients fault in pages"),
    Mutant("watchdog_engine_thread_polls_long", "ringtrain/engine/watchdog.py",
           "if self.core_per_rank and threading.current_thread().name != ENGINE_THREAD:",
           "if self.core_per_rank:",
           (Tests(("tests/test_watchdog.py",)),),
           "the engine's background thread polls instead of sleeping: with overlap it takes the training thread's "
           "core"),
    Mutant("watchdog_long_poll_stops_checking", "ringtrain/engine/watchdog.py",
           "                if waited > YIELD_S:",
           "                if False:",
           (Tests(("tests/test_watchdog.py",)),),
           "while a caller polls, a dead peer goes unnoticed and control messages do not move"),
    Mutant("eager_allreduce_skips_a_peer", "ringtrain/ops.py",
           "ufunc(arrays[0], arrays[1], out=out)",
           "ufunc(arrays[0], arrays[0], out=out)",
           (Tests(("tests/parallel/test_engine_steady_state.py",), ranks=2, select="eagerly"),),
           "a small cached allreduce, reduced from the agreement cycle's slots, leaves out rank 1"),
    Mutant("eager_data_never_copied_into_the_slot", "ringtrain/engine/executor.py",
           "        slot[:] = array.reshape(-1)\n",
           "        pass\n",
           (Tests(("tests/parallel/test_engine_steady_state.py",), ranks=2, select="eagerly"),),
           "an eager allreduce publishes its slot without its data: every rank reduces what the slot held before"),
    # ---- what a job is doing: straggler scores, flight recorder, metrics
    Mutant("straggler_blames_the_first_peer", "ringtrain/engine/stragglers.py",
           "                    self.add_wait(self.blame, self.wait_start, end)",
           "                    self.add_wait(self.exchange.peers[0], self.wait_start, end)",
           (Tests((OBSERVE,), ranks=3),),
           "a rank that waits blames its first peer, not the one that lacks what it offered"),
    Mutant("express_allreduces_never_counted", "ringtrain/engine/engine.py",
           "                self.executor.stats.record_allreduce(array.nbytes, end - start)\n",
           "",
           (Tests((OBSERVE_JOBS,), select="metrics_endpoint"),),
           "the allreduce counter never moves for the express path (every small synchronous allreduce)"),
    Mutant("metrics_bytes_counter_counts_calls", "ringtrain/core/metrics.py",
           "nbytes.add_metric(key, s[\"bytes\"])",
           "nbytes.add_metric(key, s[\"count\"])",
           (Tests((OBSERVE_JOBS,), select="metrics_endpoint"),),
           "the bytes counter exports the number of collectives"),
    Mutant("flight_recorder_keeps_the_handle_and_its_result", "ringtrain/engine/flight_recorder.py",
           "    entry[TIMES] = handle.times\n",
           "    entry[TIMES] = handle.times\n    entry.append(handle)\n",
           (Tests((OBSERVE_JOBS,), select="follows_a_handle"),),
           "the ring keeps the last 1024 results alive: memory grows, a 16 MB result pays fresh pages every call"),
    Mutant("flight_recorder_dump_misses_the_last_collective", "ringtrain/engine/flight_recorder.py",
           "for seq in range(max(1, last - self.capacity + 1), last + 1):",
           "for seq in range(max(1, last - self.capacity + 1), last):",
           (Tests((OBSERVE_JOBS,), select="last_collectives"),),
           "a dump ends one collective early: the one a rank is stuck in is missing"),
    Mutant("stall_writes_no_flight_recorder", "ringtrain/engine/observer.py",
           "        self.dump(f\"{action.error}: {action.message}\")\n",
           "",
           (Tests((OBSERVE_JOBS,), select="skipped_collective"),),
           "a stall ends collectives on every rank but no rank writes its flight recorder"),
    Mutant("doctor_sees_no_divergence_between_two_groups", "ringtrain/doctor.py",
           "if len(set(names.values())) > 1:",
           "if len(set(names.values())) > 2:",
           (Tests((OBSERVE_JOBS,), select="report_names or report_says"),),
           "the merged report misses ranks that called different collectives (or ran ahead) when only two sides"),
    Mutant("dump_flight_recorder_ignores_its_directory", "ringtrain/core/observe.py",
           "    path = state.engine().observer.dump(reason, directory)",
           "    path = state.engine().observer.dump(reason)",
           (Tests((OBSERVE,), ranks=2),),
           "dump_flight_recorder(directory) writes to the job's default directory instead"),
    Mutant("message_cycle_reads_its_own_bitmap", "ringtrain/engine/cycle_agreement.py",
           "ready &= exchange.bitmap(p, words)",
           "ready &= exchange.bitmap(self.rank, words)",
           (Tests(("tests/parallel/test_engine_steady_state.py",), ranks=4,
                  env=(("RINGTRAIN_SIMULATE_NODES", "2"),)),),
           "across (pretend) nodes a rank runs what IT has ready, not what every rank has ready"),
    Mutant("shared_array_read_at_offset_zero", "ringtrain/transports/shm.py",
           "offset=_PRIVATE if in_region is None else in_region,",
           "offset=_PRIVATE if in_region is None else 0,",
           (Tests(("tests/parallel/test_shared_arrays.py",), ranks=2, select="in_place"),),
           "peers read an empty_shared() array at the start of the region instead of where it lies"),
    Mutant("allreduce_out_forgets_the_scale", "ringtrain/transports/shm.py",
           "ops.scale_into(acc, acc, scale)",
           "pass",
           (Tests(("tests/parallel/test_collectives.py",), ranks=2, select="allreduce_large and shm"),),
           "an allreduce of one large array (no pack) is summed where it should be averaged"),
    Mutant("agreement_key_ignores_scales", "ringtrain/engine/negotiation.py",
           "return (meta.kind, meta.dtype, shape, meta.op, meta.root, meta.device, meta.scales, meta.parts)",
           "return (meta.kind, meta.dtype, shape, meta.op, meta.root, meta.device, meta.parts)",
           (Tests(("tests/parallel/test_collectives.py",), ranks=2, select="mismatch and shm"),),
           "ranks passing different prescale/postscale factors are not told"),
    Mutant("agreement_key_ignores_op", "ringtrain/engine/negotiation.py",
           "return (meta.kind, meta.dtype, shape, meta.op, meta.root, meta.device, meta.scales, meta.parts)",
           "return (meta.kind, meta.dtype, shape, meta.root, meta.device, meta.scales, meta.parts)",
           (Tests(("tests/test_negotiation.py",)),),
           "ranks reducing the same tensor with different ops are not told"),
    Mutant("fusion_mixes_scales", "ringtrain/engine/negotiation.py",
           "return (meta.dtype, meta.op, meta.device, meta.scales)",
           "return (meta.dtype, meta.op, meta.device)",
           (Tests((FUSED,), ranks=2, select="shm and (concurrent or small_tensors)"),),
           "tensors with different scales share a bucket, which has one scale"),
    Mutant("watchdog_never_fires", "ringtrain/engine/watchdog.py",
           "if not _alive(pid):",
           "if False and not _alive(pid):",
           (Tests(("tests/test_watchdog.py",)),
            Tests(("tests/test_faults.py",), select="sigkill_mid_allreduce and 2")),
           "a dead peer is never noticed"),
    Mutant("express_trusts_its_own_eager_header", "ringtrain/engine/cycle_exchange.py",
           "        for pair in self._slots:\n            header = pair[self._parity].header",
           "        for pair in self._slots[self.rank:self.rank + 1]:\n            header = pair[self._parity].header",
           (Tests((EXPRESS,), ranks=2, select="other_eager_data"),),
           "a rank reduces the cycle's slots eagerly although a peer published another tensor's data there"),
    Mutant("express_fallback_forgets_the_ready_bit", "ringtrain/engine/cycle_agreement.py",
           "        self._ready = bit\n",
           "",
           (Tests((EXPRESS,), ranks=2, select="late_peer or new_tensor"),),
           "an express call that did not finish in its cycle is never offered again: the early ranks stall"),
    Mutant("express_fallback_skips_the_slow_cycle", "ringtrain/engine/cycle_agreement.py",
           "return self._slow_cycle(c) if flags else self._fast_actions(ready)",
           "return self._fast_actions(ready)",
           (Tests((EXPRESS,), ranks=2, select="new_tensor"),),
           "an express cycle a peer flagged is not handed to the coordinator: ranks decide differently"),
    Mutant("express_agreed_skips_the_transport", "ringtrain/engine/executor.py",
           "        else:\n            self.allreduce_one(action, array, out)\n",
           "",
           (Tests((EXPRESS,), ranks=2, select="past_the_slots or with_and_without"),),
           "an allreduce too large for the slots is agreed in its express cycle but never reduced"),
    Mutant("gpu_sync_returns_before_the_stream_drained", "ringtrain/gpu.py",
           "                return\n    event.synchronize()",
           "                return",
           (Tests(("tests/test_gpu_sync.py",)),),
           "a GPU transport's sync returns after its polling budget while its kernels still run"),
    Mutant("express_off_for_good_after_a_stopped_timeline", "ringtrain/engine/engine.py",
           "(timeline is not None and not timeline.closed)",
           "timeline is not None",
           (Tests((EXPRESS,), ranks=2, select="stopped_timeline"),),
           "a closed timeline keeps every later synchronous allreduce off the express path"),
    Mutant("express_agreed_ignores_flags", "ringtrain/engine/cycle_agreement.py",
           "        if not flags and ready:\n            if self._touch",
           "        if ready:\n            if self._touch",
           (Tests((EXPRESS,), ranks=2, select="bit_in_the_flagged_cycle"),),
           "a rank runs its express allreduce although a peer flagged the cycle for the coordinator"),
    Mutant("joined_rank_reduces_without_the_scale", "ringtrain/engine/executor.py",
           "            if meta.device == \"cpu\":\n                # the same transport call",
           "            if False:\n                # the same transport call",
           (Tests(("tests/parallel/test_collectives.py",), ranks=4, select="joined"),),
           "a joined rank's zeros go through allreduce() while the others' blocks are scaled by their owners"),
    # ---- bounded caches with agreed eviction
    Mutant("cache_view_keeps_evicted_names", "ringtrain/engine/response_cache.py",
           "            if old is not None and ids.get(old) == cid:\n                del ids[old]\n",
           "            if old is not None and ids.get(old) == cid:\n                pass\n",
           (Tests((CHURN,), ranks=2, select="comes_back"),),
           "a rank still maps an evicted name to its old id, which now names another collective"),
    Mutant("cache_evicts_the_most_recently_used", "ringtrain/engine/response_cache.py",
           "self._evict(next(iter(self._recent)))",
           "self._evict(next(reversed(self._recent)))",
           (Tests(("tests/test_negotiation.py",), select="least_recently_used"),),
           "eviction throws out the entry just used instead of the least recently used"),
    Mutant("fast_path_ids_never_touched", "ringtrain/engine/cycle_agreement.py",
           "self._touch = self.coordinator.cache.touch if self.coordinator is not None else None",
           "self._touch = None",
           (Tests((CHURN,), ranks=2, select="cached_names_keep_working"),),
           "rank 0 never sees the fast path's uses: names used every step are evicted as if unused"),
    Mutant("cached_action_survives_its_id", "ringtrain/engine/cycle_agreement.py",
           "                self._single_actions.pop(cid, None)\n",
           "                pass\n",
           (Tests((CHURN,), ranks=2, select="reused_id"),),
           "an id handed to a new name still runs the collective made for the evicted one"),
    Mutant("evicted_id_reused_before_every_rank_applied_it", "ringtrain/engine/response_cache.py",
           "        if self.synchronous:\n            del self.keys[cid]",
           "        if True:\n            del self.keys[cid]",
           (Tests(("tests/test_negotiation.py",), select="asynchronous_eviction"),),
           "the coordinator protocol reuses an evicted id while a rank's message may still name it"),
    # ---- a crash in one engine ends every rank
    Mutant("crash_not_announced", "ringtrain/engine/engine.py",
           "        self.control.announce_failure(announcement)\n",
           "",
           (Tests(("tests/test_faults.py",), select="crash_in_one and agreement"),),
           "a crashed engine tells nobody: peers wait for it until its process exits or the stall timeout"),
    Mutant("watchdog_ignores_failed_peers", "ringtrain/engine/watchdog.py",
           "        if self.failed_peer is not None:\n",
           "        if False:\n",
           (Tests(("tests/test_faults.py",), select="crash_in_one and agreement"),),
           "waits never look for a peer's failure announcement"),
    Mutant("executor_failure_stays_local", "ringtrain/engine/engine.py",
           "            raise FailedIn(f\"{action.kind} of {', '.join(map(repr, action.names[:4]))}\") from e\n",
           "            return\n",
           (Tests(("tests/test_faults.py",), select="crash_in_one and executor and mpiexec"),),
           "an exception inside one rank's collective is swallowed and that rank goes on while its peers wait"),
    # ---- typed actions: the scale rule once, data only in the executor
    Mutant("collective_forgets_the_average", "ringtrain/engine/model.py",
           "fields.setdefault(\"scale\", result_scale(meta.op, postscale, size))",
           "fields.setdefault(\"scale\", postscale)",
           (Tests(("tests/test_negotiation.py",), select="scale_rule"),),
           "the agreed collective carries no 1/N for Average"),
    Mutant("collective_drops_the_prescale", "ringtrain/engine/model.py",
           "fields.setdefault(\"prescale\", prescale)",
           "fields.setdefault(\"prescale\", 1.0)",
           (Tests((SOAK,), ranks=2, select="seeded_programs and shm"),),
           "prescale_factor never reaches the reduction (found by the soak's seeded programs)"),
    Mutant("slot_reduce_ignores_the_scale", "ringtrain/engine/executor.py",
           "reduce_in_rank_order(out.reshape(-1), action.slots, action.metas[0].op, action.scale)",
           "reduce_in_rank_order(out.reshape(-1), action.slots, action.metas[0].op, 1.0)",
           (Tests(("tests/parallel/test_engine_steady_state.py",), ranks=2, select="eagerly and Average"),),
           "an allreduce reduced from the cycle's slots is summed where it should be averaged"),
    Mutant("slots_read_in_the_wrong_order", "ringtrain/engine/cycle_agreement.py",
           "slots = tuple(exchange.eager_data(p, nbytes, dtype) for p in range(self.size))",
           "slots = tuple(exchange.eager_data(p, nbytes, dtype) for p in [self.rank] * self.size)",
           (Tests((SOAK,), ranks=3, select="seeded_programs and shm"),),
           "an eager allreduce reads this rank's own slot for every rank"),
    Mutant("watchdog_takes_zombies_for_alive", "ringtrain/engine/watchdog.py",
           'return state not in (b"Z", b"X")',
           "return True",
           (Tests(("tests/test_watchdog.py",)),),
           "a peer that died but was not yet reaped by its parent counts as alive"),
    Mutant("sharded_skips_a_shards_update", "ringtrain/torch/sharded.py",
           "            for piece, view in zip(self.pieces, self.update.views):\n                view.grad = self.gradients",
           "            for piece, view in zip(self.pieces[1:], self.update.views[1:]):\n                view.grad = self.gradients",
           (Tests((SHARDED,), ranks=3, select="test_n_ranks_equal_one_process"),),
           "each rank's first piece gets no gradient, so the optimizer leaves that part of its shard unchanged"),
    Mutant("sharded_allgather_unpacks_from_a_wrong_offset", "ringtrain/torch/sharded_update.py",
           "[whole[s:s + p.numel()] for p, s in zip(params, bucket.starts)]",
           "[whole[:p.numel()] for p, s in zip(params, bucket.starts)]",
           (Tests((SHARDED,), ranks=2, select="test_n_ranks_equal_one_process"),),
           "every parameter of a bucket is unpacked from the start of the gathered bucket"),
    Mutant("sharded_clip_without_the_cross_rank_norm", "ringtrain/torch/sharded.py",
           '        functions.allreduce_(total, name=f"{self.prefix}.grad_norm"',
           '        (lambda *a, **k: None)(total, name=f"{self.prefix}.grad_norm"',
           (Tests((SHARDED,), ranks=2, select="clip"),),
           "each rank clips its shard by the norm of its own shard only"),
    Mutant("sharded_forward_uses_parameters_still_in_flight", "ringtrain/torch/sharded_update.py",
           "    for gather in list(_GATHERING):\n        gather.before_forward(module)",
           "    return",
           (Tests((SHARDED,), ranks=2, select="next_forward"),),
           "gather_parameters='forward': a module's forward runs on the parameters of the step before"),
    Mutant("sharded_one_parameter_bucket_gathered_into_a_copy", "ringtrain/torch/sharded_update.py",
           "into = like.detach().view(-1) if len(bucket.params) == 1 else None",
           "into = like.detach().view(-1).clone() if len(bucket.params) == 1 else None",
           (Tests((SHARDED,), ranks=2, select="test_n_ranks_equal_one_process"),),
           "a bucket of one parameter is allgathered into a scratch copy: the parameter keeps the other ranks' "
           "blocks of the step before"),
    Mutant("sharded_step_switches_back_to_the_users_implementation", "ringtrain/torch/sharded_update.py",
           "return dict(hyperparameters(group), **self.implementation)",
           "return hyperparameters(group)",
           (Tests((SHARDED,), ranks=2, select="fused_kernel"),),
           "syncing the user's groups into the shard's (each step, and on loading a state dict) resets fused/foreach "
           "to None: torch's slow per-operation loop on the CPU"),
    Mutant("allgather_in_place_check_compares_sizes", "ringtrain/engine/executor.py",
           "if mine.size and _address(mine) != _address(req.array):",
           "if mine.size and mine.size != req.array.size:",
           (Tests(("tests/parallel/test_collectives.py",), ranks=2, select="allgather and shm"),),
           "the in-place test of an allgather compares sizes, not memory: a separate input is never copied in"),
    Mutant("reducescatter_reduces_into_its_input", "ringtrain/engine/executor.py",
           "            transport.reducescatter_out(source, buf, counts, ReduceOp(meta.op))",
           "            transport.reducescatter_out(source, source, counts, ReduceOp(meta.op))",
           (Tests(("tests/parallel/test_collectives.py",), ranks=2, select="reducescatter and shm"),),
           "a host reducescatter reduces in the caller's input and returns a block of the staging buffer"),
    Mutant("jax_allgather_gradient_keeps_rank0_rows", "ringtrain/jax/gradients.py",
           "start = process_set.rank() * rows",
           "start = 0",
           (Tests((JAX_GRADIENTS,), ranks=2, select="allgather"),),
           "jax.grad through an allgather gives every rank the first rank's rows of the averaged cotangent"),
    Mutant("jax_bucket_average_lost", "ringtrain/jax/optimizer.py",
           "self.reducer.submit(bucket, [bucket.buffer], sync=sync)",
           "self.reducer.submit(bucket, [bucket.buffer.copy()], sync=sync)",
           # packed buckets: the host-callback lowering (under the FFI lowering the buckets are reduced in XLA's
           # buffers, jax_ffi_bucket_reduced_into_its_inputs)
           (Tests((JAX_OPTIMIZER,), ranks=2, select="equal_one_process",
                  env=(("RINGTRAIN_JAX_LOWERING", "callback"),)),),
           "DistributedOptimizer allreduces a temporary copy of each bucket: the update uses this rank's gradient"),
    Mutant("jax_ordering_token_dropped", "ringtrain/jax/host_call.py",
           "        token = ctx.tokens_in.get(COLLECTIVE)\n"
           "        results, token, _ = emit_python_callback(ctx, callback, token, list(operands), ctx.avals_in, "
           "ctx.avals_out,\n"
           "                                                 has_side_effect=True, returns_token=True)\n"
           "        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COLLECTIVE: token})))",
           "        results, token, _ = emit_python_callback(ctx, callback, None, list(operands), ctx.avals_in, "
           "ctx.avals_out,\n"
           "                                                 has_side_effect=True, returns_token=False)\n"
           "        ctx.set_tokens_out(ctx.tokens_in)",
           (Tests(("tests/test_jax_host_call.py",)),),
           "collectives lower without the ordering token: XLA may run independent ones in another order"),
    Mutant("jax_ffi_ordering_token_dropped", "ringtrain/jax/host_call.py",
           "    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({COLLECTIVE: token})))\n"
           "    return results\n\n\ndef copy_results",
           "    ctx.set_tokens_out(ctx.tokens_in)\n"
           "    return results\n\n\ndef copy_results",
           (Tests(("tests/test_jax_host_call.py",)),),
           "the FFI custom call takes the token but does not pass it on: XLA may run independent ones in another "
           "order"),
    Mutant("jax_ffi_in_place_ignored", "ringtrain/jax/host_call.py",
           "len(operands) if in_place else 0",
           "0",
           (Tests(("tests/test_jax_host_call.py",)),),
           "in_place=True lowers without the operand-output aliases: XLA allocates fresh outputs every call"),
    Mutant("jax_reduction_ordered_flag_ignored", "ringtrain/jax/optimizer.py",
           "primitive = ordered_reduce_gradients_p if ordered else reduce_gradients_p",
           "primitive = reduce_gradients_p",
           (Tests((JAX_OPTIMIZER,), ranks=2, select="no_jax_effect"),),
           "DistributedOptimizer(ordered=True) still reduces without the ordering token"),
    Mutant("jax_ffi_bucket_reduced_into_its_inputs", "ringtrain/jax/optimizer.py",
           "outs=[outputs[k] for k in keys], sync=True)",
           "outs=None, sync=True)",
           (Tests((JAX_OPTIMIZER,), ranks=2, select="equal_one_process"),),
           "under jit a bucket is reduced into XLA's input buffers, not into its output buffers"),
    Mutant("grouped_express_reduces_into_its_inputs", "ringtrain/core/collectives.py",
           "done = eng.express(name, meta, source, source if in_place else Segments(outs))",
           "done = eng.express(name, meta, source, source)",
           (Tests((GROUPED_EXPRESS,), ranks=2),),
           "a cached synchronous grouped allreduce with outs writes its results into its inputs"),
    Mutant("segments_copy_out_skipped", "ringtrain/transports/shm.py",
           "                            fill(mine(p, out), region(r, p, _PRIVATE))",
           "                            if not isinstance(out, Segments):\n"
           "                                fill(mine(p, out), region(r, p, _PRIVATE))",
           (Tests((GROUPED_EXPRESS,), ranks=2), Tests((JAX_OPTIMIZER,), ranks=2, select="equal_one_process")),
           "arrays reduced where they lie never get the blocks their peers reduced"),
    Mutant("segments_runs_cross_arrays", "ringtrain/transports/segments.py",
           "end = min(hi, self.starts[member] + self.arrays[member].size, lo + limit)",
           "end = min(hi, lo + limit)",
           (Tests(("tests/test_segments.py",)), Tests((GROUPED_EXPRESS,), ranks=2)),
           "the reduction's pieces run across an array's end"),
    Mutant("grouped_express_fallback_not_grouped", "ringtrain/engine/engine.py",
           "                              HOST_OPS, grouped=True)",
           "                              HOST_OPS)",
           (Tests((GROUPED_EXPRESS,), ranks=2, select="flagged"),),
           "a grouped express call that becomes a request returns one array instead of the list"),
    Mutant("peer_failure_waits_for_the_periodic_check", "ringtrain/engine/watchdog.py",
           "            self._next_check = 0.0\n            try:\n                self.check()",
           "            try:\n                self.check()",
           (Tests(("tests/test_watchdog.py",), select="peer_failure"),),
           "an MPI error on a just-killed peer is called this engine's crash: the dead peer is looked for only at "
           "the next periodic check"),
    Mutant("elastic_restore_skipped", "ringtrain/elastic/runner.py",
           "                    state.restore()\n",
           "                    pass\n",
           (Tests((ELASTIC,), select="sigkilled_worker"),),
           "after a worker died the survivors go on from their live state, not their last commit"),
    Mutant("elastic_sync_from_the_wrong_rank", "ringtrain/torch/elastic_state.py",
           "broadcast_parameters(self.value.state_dict(), root_rank=root)",
           "broadcast_parameters(self.value.state_dict(), root_rank=__import__('ringtrain').size() - 1)",
           (Tests((ELASTIC,), select="joins"),),
           "sync() hands the parameters of the last rank (a worker that just joined) to everyone"),
    Mutant("elastic_sync_drops_the_optimizer_state", "ringtrain/torch/elastic_state.py",
           "        broadcast_optimizer_state(self.value, root_rank=root)\n",
           "        pass\n",
           (Tests((ELASTIC_LOSSLESS,), select="random_moment"),),
           "sync() hands over parameters but not the optimizer state: a worker that joins steps with no momentum "
           "(and a survivor that missed the last step keeps its old one)"),
    Mutant("elastic_average_by_the_old_size", "ringtrain/ops.py",
           "    return postscale / size if op == ReduceOp.AVERAGE else postscale",
           "    return (postscale / result_scale.__dict__.setdefault('first', size) if op == ReduceOp.AVERAGE\n"
           "            else postscale)",
           (Tests((ELASTIC_LOSSLESS,), select="random_moment"),),
           "after a re-formation op=Average still divides by the first world's size"),
    Mutant("elastic_redeal_loses_a_sample", "ringtrain/elastic/sampler.py",
           "        self.remaining_indices = remaining\n",
           "        self.remaining_indices = remaining[1:] if self.processed_indices else remaining\n",
           (Tests((ELASTIC_LOSSLESS,), select="random_moment"),),
           "the samples dealt again after a failure lose one: the epoch ends with a sample never trained"),
    Mutant("elastic_lossless_sync_from_rank_0", "ringtrain/elastic/state.py",
           "        self.sync_from(root)\n",
           "        self.sync_from(0)\n",
           (Tests((ELASTIC_PIECES,), select="furthest_rank"),),
           "lossless sync() takes rank 0's state even when another survivor completed one step more"),
    Mutant("elastic_backup_shard_not_updated", "ringtrain/torch/elastic_shards.py",
           "        self.copy.step()\n",
           "        pass\n",
           (Tests((ELASTIC_LOSSLESS,), select="sharded and gradients"),),
           "the copy of the neighbour's shard is not stepped: when that neighbour dies its shard comes back from a "
           "stale copy (old optimizer state and parameters)"),
    Mutant("elastic_formation_goes_before_every_worker_answered", "ringtrain/launch/elastic_driver.py",
           '            if len(self.forming["answered"]) == len(self.forming["members"]):\n',
           '            if self.forming["answered"]:\n',
           (Tests((ELASTIC_LOSSLESS,), select="sharded and gradients",
                  env=(("RINGTRAIN_TEST_FORM_KILL_AT", "plan"),)),),
           "the formation barrier lets the workers into MPI at the first answer: a worker that dies before answering "
           "leaves the others blocked in MPI's Accept and the job ends"),
    Mutant("elastic_death_inside_the_formation_ends_the_job", "ringtrain/launch/elastic_driver.py",
           '            when = "while" if self.forming["started"] else "before"\n',
           '            if self.forming["started"]:\n'
           '                raise ElasticJobError(f"worker {worker.label()} {how} while world {self.generation} formed")\n'
           '            when = "before"\n',
           (Tests((ELASTIC_LOSSLESS,), select="sharded and gradients",
                  env=(("RINGTRAIN_TEST_FORM_KILL_AT", "mpi"), ("RINGTRAIN_TEST_SEED", "2"))),),
           "a worker that dies once the world's MPI Accept/Connect began ends the job instead of a new plan"),
    Mutant("elastic_joiner_connects_to_an_abandoned_world", "ringtrain/world/elastic_worker.py",
           "    if _given_up(driver, generation):\n        raise _Abandoned()\n    return MPI.COMM_SELF.Connect",
           "    return MPI.COMM_SELF.Connect",
           (Tests((ELASTIC_LOSSLESS,), select="sharded and gradients",
                  env=(("RINGTRAIN_TEST_FORM_KILL_AT", "mpi"), ("RINGTRAIN_TEST_SEED", "1"))),),
           "a joiner told to connect connects although the world's rank 0 died meanwhile: on libfabric's tcp provider "
           "its Connect hangs, and the survivor is lost (it exits after its connect timeout)"),
    Mutant("elastic_workers_on_libfabrics_default_provider", "ringtrain/launch/elastic_workers.py",
           '        env.setdefault("FI_PROVIDER", "tcp")\n', "",
           (Tests((ELASTIC,), select="exchange_in_flight"),),
           "elastic workers on libfabric's default provider: a survivor with an exchange in flight with a worker "
           "that dies is aborted by MPICH (a completion-queue error, fatal whatever the error handler)"),
    Mutant("elastic_workers_finalize_mpi", "ringtrain/launch/elastic_workers.py",
           '        env.setdefault("MPI4PY_RC_FINALIZE", "false")\n', "",
           (Tests((ELASTIC_LOSSLESS,), select="rollback"),),
           "elastic workers call MPI_Finalize at exit: with the worlds they left still allocated it fails to close "
           "the fabric and MPICH aborts the finished worker (exit code 15)"),
    Mutant("elastic_steps_not_counted", "ringtrain/torch/elastic_state.py",
           "            self.steps += 1\n",
           "",
           (Tests((ELASTIC_PIECES,), select="counts_each"),),
           "the lossless state does not count its optimizer's steps: every survivor looks alike and rank 0's "
           "state wins, a step behind when rank 0 missed it"),
    Mutant("elastic_host_check_acts_on_old_news", "ringtrain/elastic/lossless.py",
           "        if seq < 0 or seq <= self.seen:\n",
           "        if seq < 0:\n",
           (Tests((ELASTIC_PIECES,), select="host_check"),),
           "a notice some rank heard late raises HostsUpdatedInterrupt a second time"),
    Mutant("elastic_boundary_stops_at_the_largest_report", "ringtrain/launch/elastic_driver.py",
           '        steps = max(news["reports"].values(), default=0) + 1\n',
           '        steps = max(news["reports"].values(), default=0)\n',
           (Tests((ELASTIC_PIECES,), select="stop_step"),),
           "the driver stops the world after the furthest step any rank reported: a rank already inside the next "
           "step never meets it, and the world stops on some ranks only"),
    Mutant("elastic_boundary_does_not_wait_for_the_answer", "ringtrain/world/elastic_boundary.py",
           "            if generation in self._reported and generation not in self._answers:\n",
           "            if False:\n",
           (Tests((ELASTIC_PIECES,), select="stop_step or boundary_wait"),),
           "a rank that reported its steps goes past the next one before the driver's answer: it misses the step the "
           "world stops at"),
    Mutant("elastic_removed_only_stop_takes_in_a_newcomer", "ringtrain/launch/elastic_driver.py",
           '        if self.news is not None and not self.news["added"] and self.failed_at is None:\n',
           '        if False:\n',
           (Tests((ELASTIC_PIECES,), select="takes_in_no_newcomer"),),
           "a world stopped for removed workers only (its members skip the sync) takes in a newcomer that became "
           "ready meanwhile: the newcomer syncs alone and the world hangs"),
    Mutant("elastic_workers_keep_the_users_sockets_provider", "ringtrain/launch/elastic_workers.py",
           '            self.env["FI_PROVIDER"] = "tcp"\n', "",
           (Tests((ELASTIC_PIECES,), select="sockets_provider"),),
           "a user's FI_PROVIDER=sockets reaches the elastic workers: a 4-worker job trains to the end and its "
           "workers never exit"),
    Mutant("elastic_broken_sync_leaves_a_source", "ringtrain/elastic/state.py",
           "        return -1 if self._handing_over else self.steps_completed()\n",
           "        return self.steps_completed()\n",
           (Tests((ELASTIC_PIECES,), select="broken_sync"),),
           "a rank whose sync broke half way (its source died) offers its half-overwritten state as a source"),
    Mutant("elastic_channel_drops_what_came_with_the_hello", "ringtrain/launch/elastic_channel.py",
           "        return [(worker, message) for message in more]\n",
           "        return []\n",
           (Tests((ELASTIC_PIECES,), select="driver_channel"),),
           "a worker's first messages sent in the same segment as its hello ('ready') are lost: the first world "
           "never forms"),
    Mutant("elastic_removed_worker_does_not_leave", "ringtrain/world/elastic_worker.py",
           "        sys.exit(0)\n",
           "        pass\n",
           (Tests((ELASTIC_LOSSLESS,), select="scale_down"),),
           "a worker whose slot was removed reads the driver's 'leave' as a world plan and crashes instead of "
           "leaving: the driver counts it as a death"),
    Mutant("elastic_stuck_survivor_never_leaves", "ringtrain/world/elastic_worker.py",
           '                    if message["generation"] == self.generation and self.in_world:\n',
           '                    if False:\n',
           (Tests((ELASTIC_LOSSLESS,), select="stuck_after_a_death"),),
           "a survivor hung after a peer's death (MPICH's ofi abort) has no leave watchdog: the others wait for it "
           "until the driver's backstop kills it"),
    Mutant("elastic_driver_waits_when_no_worker_can_come", "ringtrain/launch/elastic_driver.py",
           "            if not self._more_workers_possible():",
           "            if False:",
           (Tests((ELASTIC,), select="blacklisted_for_good"),),
           "below --min-np with every host blacklisted for good, the driver waits out --elastic-timeout for nothing"),
    Mutant("elastic_keras_commit_count_kept_across_worlds", "ringtrain/keras/elastic_state.py",
           "        state.register_reset_callbacks([self._restart_count])\n",
           "",
           (Tests((ELASTIC,), select="keras_fit_sigkilled"), Tests((ELASTIC,), select="keras_fit_worker_added")),
           "Horovod's CommitStateCallback: after a re-form each survivor keeps the batch count it stopped at, so "
           "survivors that failed in different batches (or a joiner, which starts afresh) commit at different "
           "batches and the job stalls"),
    Mutant("engine_cycle_sends_after_the_world_was_aborted", "ringtrain/engine/cycle_exchange.py",
           '        self.watchdog.check_sendable(f"agreement cycle {c}")\n', "",
           (Tests(("tests/test_watchdog.py",), select="aborted_world_sends_no"),
            Tests((ELASTIC,), select="different_commits", env=(("MPIR_CVAR_CH4_NETMOD", "ucx"),))),
           "an idle survivor follows a peer into an agreement cycle after the driver said a worker died, and its "
           "send to the dead rank crashes the process inside MPICH's ucx module (SIGSEGV in MPI_Isend)"),
    Mutant("elastic_workers_on_mpichs_ucx_module", "ringtrain/launch/elastic_workers.py",
           '        env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")\n', "",
           (Tests((ELASTIC,), select="exchange_in_flight"),),
           "elastic workers on MPICH's default (ucx) network module: a survivor's send to a worker that just died "
           "crashes it inside MPI_Isend"),
    Mutant("elastic_waits_leave_mpi_progress_to_the_peer_checks", "ringtrain/world/join.py",
           "        config.drive_mpi_progress = True      # a joined world (below)\n", "",
           (Tests((ELASTIC,), select="drive_mpi_progress"),),
           "an elastic world's waits and idle engine passes make no MPI call of their own: a root's broadcast data "
           "sits in its process until the next peer check, every peer_check_s"),
    Mutant("joined_world_waits_leave_mpi_progress_to_the_peer_checks", "ringtrain/world/join.py",
           "    config.drive_mpi_progress = True\n", "",
           (Tests(("tests/test_launch_environment.py",), select="drive_mpi_progress"),),
           "a torchrun-style joined world's waits make no MPI call of their own: on MPICH's ofi a root's broadcast "
           "data sits in its process until the next peer check, every peer_check_s"),
    Mutant("elastic_steps_elastic_launch_is_plain", "benchmarks/elastic_steps.py",
           '["--min-np", str(n)] if kind == "elastic"', '[] if kind == "elastic"',
           (Tests(("tests/test_benchmarks.py",), select="elastic_steps"),),
           "the benchmark's elastic arm runs a plain mpiexec job: elastic / plain reads 1.0 whatever elastic costs"),
    Mutant("engine_idle_passes_leave_mpi_progress_to_the_waits", "ringtrain/engine/engine.py",
           "        elif self.control.drives_mpi:\n"
           "            self.control.progress()       # MPI moves what this rank handed it only inside MPI calls\n",
           "",
           (Tests(("tests/test_engine_idle_progress.py",)),),
           "an elastic or joined world's rank with nothing to run makes no MPI call: the coordinator's answer it sent "
           "sits in its process (measured: elastic step + commit 163 ms median at 4 workers against 42 ms)"),
    Mutant("spark_ray_ranks_on_mpichs_default_network_module", "ringtrain/launch/task.py",
           '        rank_env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")\n', "",
           (Tests(("tests/test_launch_environment.py",), select="spark_or_ray"),),
           "Spark/Ray ranks on one machine joined over ucx: each its own node, the mpi transport, 1.5x slower steps"),
    Mutant("topology_falls_back_to_nodes_of_one_silently", "ringtrain/topology.py",
           '                  "start them with MPIR_CVAR_CH4_NETMOD=ofi.", RuntimeWarning, stacklevel=2)\n',
           '                  "start them with MPIR_CVAR_CH4_NETMOD=ofi.", ResourceWarning, stacklevel=2)\n',
           (Tests(("tests/test_launch_environment.py",), select="become_one_world"),),
           "joined ranks that cannot share memory run 1.5x slower with no word of the fix (ResourceWarning is hidden)"),
    Mutant("agreement_ignores_drive_mpi_progress", "ringtrain/engine/engine.py",
           "ControlChannel(self.ctrl, self.watchdog, config.drive_mpi_progress)",
           "ControlChannel(self.ctrl, self.watchdog, False)",
           (Tests(("tests/test_launch_environment.py",), select="drive_mpi_progress"),),
           "the engine's waits never drive MPI's progress, whatever init() decided for the world"),
    Mutant("control_channel_never_probes_mpi", "ringtrain/engine/control.py",
           "        if self.drives_mpi:\n            self.ctrl.Iprobe(",
           "        if False:\n            self.ctrl.Iprobe(",
           (Tests(("tests/test_engine_idle_progress.py",)),),
           "the control channel's progress() never probes MPI, even in a world whose MPI moves data only inside calls"),
    Mutant("control_channel_probes_an_aborted_world", "ringtrain/engine/control.py",
           "        if self.watchdog.abort_reason is not None:\n            return",
           "        if False:\n            return",
           (Tests(("tests/test_engine_idle_progress.py",)),),
           "a survivor keeps probing its world after the driver's word of a death: MPICH's ofi aborts it when the "
           "probe meets the dead peer's completion error"),
    Mutant("driver_count_never_released", "ringtrain/engine/driving.py",
           "            with engine._state_lock:\n                self.count -= 1",
           "            with engine._state_lock:\n                pass",
           (Tests((API_FORMS,), ranks=2, select="never_waited"),),
           "after a caller's first wait the background thread thinks a caller still drives and never runs a pass: "
           "async collectives move only inside their own wait()"),
    Mutant("mpi_broadcast_starts_after_the_world_was_aborted", "ringtrain/transports/mpi_util.py",
           "        self.watchdog.check_sendable(what)\n", "",
           (Tests(("tests/test_engine_failures.py",), select="aborted"),),
           "a broadcast agreed just before an elastic world's abort starts its sends towards the dead worker"),
    Mutant("mpi_alltoall_starts_after_the_world_was_aborted", "ringtrain/transports/mpi_util.py",
           '        self.watchdog.check_sendable("alltoall")\n', "",
           (Tests(("tests/test_engine_failures.py",), select="aborted"),),
           "an alltoall agreed just before an elastic world's abort starts its sends towards the dead worker"),
    Mutant("engine_names_an_mpi_error_a_crash_not_the_dead_peer", "ringtrain/engine/failure.py",
           "    if isinstance(e, (FailedIn, MPI.Exception)) and size > 1:\n",
           "    if isinstance(e, FailedIn) and size > 1:\n",
           (Tests(("tests/test_engine_failures.py",), select="names_the_peer"),),
           "an MPI error from the agreement's send to a just-killed peer (ofi) reads 'engine crashed' instead of "
           "naming the dead rank"),
    Mutant("elastic_sync_unites_the_sampler_records", "ringtrain/torch/elastic_state.py",
           "        self.value.load_state_dict(collectives.broadcast_object(self.value.state_dict(), root_rank=root))\n",
           "        state_dict = collectives.broadcast_object(self.value.state_dict(), root_rank=root)\n"
           "        everyone = collectives.allgather_object(self.value.processed_indices)\n"
           "        state_dict['processed_indices'] = set().union(*everyone)\n"
           "        self.value.load_state_dict(state_dict)\n",
           (Tests((ELASTIC,), select="different_commits"),),
           "sync() hands out rank 0's parameters with every survivor's sampler record united: a survivor that saved "
           "a later commit marks samples done that rank 0's parameters never trained"),
    Mutant("elastic_sampler_records_only_its_own_batch", "ringtrain/elastic/sampler.py",
           "self.get_indices(batch_idx, batch_size, all_ranks=True)",
           "self.get_indices(batch_idx, batch_size)",
           (Tests((ELASTIC_PIECES,)), Tests((ELASTIC,), select="sigkilled_worker")),
           "Horovod's sampler: a dead rank's processed samples are forgotten and served again after the resize"),
    Mutant("step_breakdown_traffic_floor_without_the_push", "benchmarks/step_breakdown.py",
           "            for peer in peers:\n                peer[a:b] = result[a:b]\n",
           "",
           (Tests((BENCHMARKS,), select="step_breakdown_quick"),),
           "lockstep+traffic leaves out the push of the reduced block to the peers: a floor too low, its step too "
           "fast, and ringtrain measured against less than an allreduce"),
    Mutant("step_breakdown_traffic_floor_without_the_copy_in", "benchmarks/step_breakdown.py",
           "            if p != self.rank:\n                mine[lo:hi] = self.gradients[lo:hi]\n",
           "            pass\n",
           (Tests((BENCHMARKS,), select="step_breakdown_quick"),),
           "lockstep+traffic leaves out the copy-in of the blocks peers reduce: peers reduce whatever the window "
           "held"),
    Mutant("step_breakdown_traffic_views_floor_without_views", "benchmarks/step_breakdown.py",
           "        if views:\n            self._point_grads()\n",
           "",
           (Tests((BENCHMARKS,), select="step_breakdown_quick"),),
           "lockstep+traffic:views never points the .grad at the window: backward hands over fresh gradients that "
           "nothing reads, and the floor leaves out the zeroing and the adds"),
    Mutant("reducer_zero_grad_ignores_work_in_flight", "ringtrain/reducer/reducer.py",
           "        if self.pending:\n            writing = (",
           "        if False:\n            writing = (",
           (Tests(("tests/test_torch_binding.py",), select="zero_grad_with_pending_allreduce"),),
           "zero_grad() between backward and step() drops the gradients while allreduces still write into them"),
    Mutant("reducer_finalize_forgets_the_remaining_buckets", "ringtrain/reducer/reducer.py",
           "            self.submit_remaining(launch_remaining, last_ready_first=last_ready_first)\n",
           "            pass\n",
           (Tests(("tests/test_torch_binding.py",), select="last_ready_bucket_is_reduced_first"),),
           "the step's end never launches the buckets backward did not: after backward nothing is reduced"),
    Mutant("reducer_finalize_never_learns_the_order", "ringtrain/reducer/reducer.py",
           "            self.learn_order()\n            if after_wait is not None:",
           "            if after_wait is not None:",
           (Tests(("tests/parallel/test_torch_optimizer.py",), ranks=2,
                  select="first_allreduce_is_submitted_before_backward_ends"),),
           "after the first step the buckets are never re-laid in the observed ready order"),
    Mutant("import_graph_transport_reads_the_core_state", "ringtrain/transports/choice.py",
           "    \"\"\"'auto', True or False from RINGTRAIN_HIERARCHICAL / init(hierarchical=...).\"\"\"\n",
           "    \"\"\"'auto', True or False from RINGTRAIN_HIERARCHICAL / init(hierarchical=...).\"\"\"\n"
           "    from ..core.state import config  # noqa: F401\n",
           (Tests((IMPORT_GRAPH,), select="points_up"),),
           "a transport reaches up into the core API's state from inside a function, where Python does not see it"),
    Mutant("import_graph_circle_through_a_package_init", "ringtrain/world/join.py",
           "    from . import elastic_worker as worker\n",
           "    from . import elastic_worker as worker\n    import ringtrain.elastic  # noqa: F401\n",
           (Tests((IMPORT_GRAPH,), select="circle_in_the_package"),),
           "joining a world imports the elastic package from inside a function: its __init__ runs the runner, which "
           "needs the core state, which joins the world"),
    # ---- modules whose logic had no planted bug: launch, elastic pieces, reducer helpers, bottom modules ----
    Mutant("elastic_sampler_deals_a_sample_to_nobody", "ringtrain/elastic/sampler.py",
           "self.indices = remaining[self.rank::self.num_replicas]",
           "self.indices = remaining[self.rank::self.num_replicas + 1]",
           (Tests((ELASTIC_PIECES,), select="sampler"),),
           "after a resize the remaining samples are dealt with a stride one too large: some are never trained"),
    Mutant("elastic_sampler_forgets_the_record_on_load", "ringtrain/elastic/sampler.py",
           'self.processed_indices = set(state_dict["processed_indices"])',
           "self.processed_indices = set()",
           (Tests((ELASTIC_PIECES,), select="sampler"),),
           "a synced sampler re-deals samples that committed steps already trained"),
    Mutant("discovery_failure_reads_as_hosts", "ringtrain/launch/hosts.py",
           "    if done.returncode != 0:",
           "    if done.returncode < 0:",
           (Tests((ELASTIC_PIECES,), select="discovery"),),
           "a discovery script that exits non-zero is trusted for whatever it printed"),
    Mutant("shard_plan_piece_stops_one_short", "ringtrain/reducer/sharding.py",
           "a, z = max(lo, start), min(hi, end)",
           "a, z = max(lo, start), min(hi, end - 1)",
           (Tests(("tests/test_sharding.py",)),),
           "each parameter's last element owned by no rank"),
    Mutant("shard_overlaps_accepts_a_gap", "ringtrain/reducer/sharding.py",
           "    if covered != length:",
           "    if covered > length:",
           (Tests(("tests/test_sharding.py",)),),
           "resharding reads a range the saved pieces do not cover"),
    Mutant("cast_compression_casts_integers", "ringtrain/reducer/compression.py",
           "if cls.is_floating(original) and original != cls.wire_dtype:",
           "if original != cls.wire_dtype:",
           (Tests(("tests/test_shared_binding_pieces.py",), select="cast_compressor"),),
           "fp16 compression casts integer gradients too (a wrong dtype rule)"),
    Mutant("stats_blames_the_fastest_rank", "ringtrain/stats.py",
           "slowest_mean, slowest_rank = max(means)",
           "slowest_mean, slowest_rank = min(means)",
           (Tests(("tests/test_timeline.py",), select="summary"),),
           "the shutdown summary names the wrong rank as the slowest"),
    Mutant("threads_per_rank_ignores_hosts", "ringtrain/launch/run.py",
           "ranks_here = math.ceil(num_ranks / num_hosts)",
           "ranks_here = num_ranks",
           (Tests(("tests/test_launcher.py",), select="threads_per_rank"),),
           "on several hosts each rank gets a share of one host's cores divided by every rank"),
    Mutant("plan_world_joins_without_a_rendezvous", "ringtrain/world/environment.py",
           'torch_style = all(environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))',
           'torch_style = all(environ.get(k) for k in ("RANK", "WORLD_SIZE"))',
           (Tests(("tests/test_launch_environment.py",)),),
           "processes with RANK and WORLD_SIZE but no MASTER_ADDR/PORT are told they will be joined"),
    Mutant("process_set_root_is_not_translated", "ringtrain/core/routing.py",
           "        return self.ranks.index(world_rank)",
           "        return world_rank % len(self.ranks)",
           (Tests(("tests/parallel/test_process_sets.py",), ranks=4),),
           "a broadcast in a set takes root_rank as a rank of the set instead of a world rank"),
    Mutant("mpi_baseline_reducescatter_keeps_the_wrong_block", "ringtrain/transports/mpi.py",
           "start = offsets(counts)[self.rank]",
           "start = offsets(counts)[(self.rank + 1) % self.size]",
           (Tests(("tests/parallel/test_transports.py",), ranks=3, select="reducescatter"),),
           "MPI's reduce-scatter baseline writes this rank's block where the next rank's belongs"),
    Mutant("sync_batch_norm_running_var_biased", "ringtrain/torch/sync_batch_norm.py",
           "unbiased = var * (count / max(count - 1, 1))",
           "unbiased = var",
           (Tests(("tests/parallel/test_sync_batch_norm.py",), ranks=2),),
           "the running variance keeps the biased batch variance (torch's BatchNorm keeps the unbiased one)"),
    Mutant("model_check_misses_a_shape_difference", "ringtrain/reducer/model_check.py",
           "        if len(seen) > 1:",
           "        if len(seen) > 2:",
           (Tests(("tests/test_torch_binding.py",), select="model_mismatch"),),
           "two ranks whose parameter shapes differ are let through to a reduction of mismatched buckets"),
    Mutant("consistency_misses_a_drifting_rank", "ringtrain/torch/consistency.py",
           "        if len(groups) > 1:\n            # the largest group",
           "        if len(groups) > 2:\n            # the largest group",
           (Tests(("tests/parallel/test_consistency.py",), ranks=2),),
           "check_parameters passes when one rank's parameters drifted from the others'"),
    Mutant("timeline_every_rank_writes_the_one_file", "ringtrain/timeline.py",
           "        return path if rank == 0 else None",
           "        return path",
           (Tests(("tests/test_timeline.py",), select="which_ranks"),),
           "without RINGTRAIN_TIMELINE_ALL_RANKS every rank writes (and clobbers) rank 0's file"),
    Mutant("auto_transport_picks_shm_across_nodes", "ringtrain/transports/choice.py",
           'return ("flat", "shm" if num_nodes == 1 and size > 1 else "mpi")',
           'return ("flat", "shm" if size > 1 else "mpi")',
           (Tests(("tests/test_topology.py",), select="host_plan"),),
           "without the hierarchy the automatic choice maps one shared window across machines"),
    Mutant("jax_unsigned_average_divides_by_one_rank_too_few", "ringtrain/jax/arrays.py",
           "                result //= self.dtype.type(size)",
           "                result //= self.dtype.type(max(size - 1, 1))",
           (Tests(("tests/parallel_jax/test_jax_collectives.py",), ranks=3, select="allreduce_every"),),
           "an unsigned Average (reduced as a signed Sum) divided by the wrong rank count"),
    Mutant("load_shards_plans_the_old_layout_from_the_new_buckets", "ringtrain/torch/sharded_checkpoint.py",
           'old = ShardPlan(numels, buckets, layout["size"])',
           'old = ShardPlan(numels, self.plan.describe()[1], layout["size"])',
           (Tests((SHARDED,), ranks=2, select="other_buckets"),),
           "a checkpoint saved with other buckets (bucket_cap_mb changed) is read with the current ones: wrong state"),
    Mutant("checkpoint_load_keeps_each_ranks_own_optimizer_state", "ringtrain/torch/checkpoint.py",
           "        if optimizer is not None and not _is_sharded(optimizer):\n"
           "            broadcast_optimizer_state(optimizer, root_rank=0)",
           "        if optimizer is not None and not _is_sharded(optimizer) and False:\n"
           "            broadcast_optimizer_state(optimizer, root_rank=0)",
           (Tests(("tests/parallel/test_checkpoint.py",), ranks=2),),
           "load_checkpoint restores the optimizer on rank 0 only; the others keep their own momentum"),
    Mutant("checkpoint_reads_any_dict", "ringtrain/torch/checkpoint.py",
           'if not isinstance(payload, dict) or payload.get("format") != FORMAT:',
           "if not isinstance(payload, dict):",
           (Tests(("tests/test_checkpoint.py",), select="not_a_checkpoint"),),
           "a file that is not a ringtrain checkpoint fails deep inside with a KeyError, not a clear error"),
    Mutant("allgather_gradient_takes_rank_zeros_rows", "ringtrain/torch/autograd.py",
           "return grad.narrow(0, int(counts[:me].sum()), rows)",
           "return grad.narrow(0, 0, rows)",
           (Tests(("tests/parallel/test_torch_autograd.py",), ranks=3),),
           "the gradient of an allgather hands every rank the first rank's rows"),
    Mutant("add_process_set_takes_any_ranks", "ringtrain/core/set_registry.py",
           "    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):",
           "    if not ranks or len(set(ranks)) != len(ranks):",
           (Tests(("tests/parallel/test_process_sets.py",), ranks=2, select="collective_and_checked"),),
           "a process set naming a rank that does not exist is accepted"),
    Mutant("jax_reducescatter_blocks_give_the_remainder_to_the_last", "ringtrain/jax/reducescatter.py",
           "        return tuple(rows // n + (k < rows % n) for k in range(n))",
           "        return tuple(rows // n + (k >= n - rows % n) for k in range(n))",
           (Tests(("tests/parallel_jax/test_jax_collectives.py",), ranks=3, select="reducescatter"),),
           "jax's reducescatter block shapes disagree with the core's split (the first ranks take the remainder)"),
    Mutant("elastic_restore_keeps_the_live_momentum", "ringtrain/torch/elastic_state.py",
           "class _OptimizerHandler(_ModelHandler):\n    def __init__(self, optimizer, state):",
           "class _OptimizerHandler(_ModelHandler):\n    def restore(self):\n        pass\n\n"
           "    def __init__(self, optimizer, state):",
           (Tests((ELASTIC_LOSSLESS,), select="rollback"),),
           "a roll-back restores the model but leaves the optimizer's momentum from the undone step"),
    Mutant("object_state_commit_keeps_a_reference", "ringtrain/elastic/state.py",
           "        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}",
           "        self._saved_state = {name: getattr(self, name) for name in self._saved_state}",
           (Tests((ELASTIC_PIECES,), select="object_state"),),
           "commit() keeps the live objects, so in-place changes after it leak into the roll-back"),
    Mutant("keras_keeps_xla_on_for_the_host_callback", "ringtrain/keras/xla.py",
           "    if setting:\n        return False, XLA_WARNING",
           "    if setting is True and False:\n        return False, XLA_WARNING",
           (Tests(("tests/test_tf_binding.py",), select="xla_decision"),),
           "Keras's resolved jit_compile=True is kept: XLA would try to compile ringtrain's host callback"),
    Mutant("reducer_shards_sum_where_average_was_asked", "ringtrain/reducer/reducer.py",
           "            result = start(arrays[0], **kwargs)",
           '            result = start(arrays[0], **{**kwargs, "op": "sum"})',
           (Tests(("tests/parallel/test_reducer_ranks.py",), ranks=2),),
           "a sharded optimizer's reducescatter buckets sum the ranks' gradients where op=Average was asked"),
    Mutant("driver_protocol_drops_a_partial_line", "ringtrain/world/elastic_protocol.py",
           "        self._pending = lines.pop()",
           '        lines.pop()\n        self._pending = b""',
           (Tests((ELASTIC_PIECES,), select="protocol"),),
           "a message split across two reads of the driver's socket is lost"),
    Mutant("elastic_min_np_above_np_accepted", "ringtrain/launch/options.py",
           "    if not 1 <= min_np <= args.num_ranks or (args.max_np is not None and args.num_ranks > args.max_np):",
           "    if min_np < 1 or (args.max_np is not None and not min_np <= args.num_ranks <= args.max_np):",
           (Tests(("tests/test_launcher.py",), select="elastic_flags"),),
           "--min-np above -np is accepted when --max-np is not given (the job could never start)"),
    Mutant("torch_compression_casts_integer_gradients", "ringtrain/torch/compression.py",
           "        return dtype.is_floating_point",
           "        return True",
           (Tests(("tests/test_torch_binding.py",), select="compression"),),
           "fp16/bf16 compression casts integer tensors too"),
    # the docs: a page that contradicts the code fails tests/test_docs_truth.py
    # (ringtrain.tensorflow has every Horovod name now, SyncBatchNormalization included: the planted name is a
    # misspelling of one)
    Mutant("docs_tensorflow_claims_a_name_it_lacks", "docs/porting/horovod.md",
           "`ringtrain.tensorflow` keeps Horovod's names: `DistributedGradientTape`,",
           "`ringtrain.tensorflow` keeps Horovod's names: `DistributedTape`, `DistributedGradientTape`,",
           (Tests(("tests/test_docs_truth.py",), select="porting_tables and horovod"),),
           "the porting page says ringtrain.tensorflow keeps a name it does not have"),
    Mutant("docs_torch_table_lists_is_homogeneous", "docs/porting/horovod.md",
           "| `size`, `local_size`, `cross_size`, `rank`, `local_rank`, `cross_rank` | supported | extra",
           "| `size`, `local_size`, `cross_size`, `rank`, `local_rank`, `cross_rank`, `is_homogeneous` | supported"
           " | extra",
           (Tests(("tests/test_porting_guide_names.py",), select="horovods_exports"),),
           "the horovod.torch table lists is_homogeneous, which horovod.torch 0.28.1 does not export"),
    Mutant("docs_h_flag_makes_a_job_elastic", "docs/guides/launching.md",
           "- Any of `--min-np`, `--max-np` or `--host-discovery-script` makes the job elastic;",
           "- Any of `--min-np`, `--max-np`, `-H` or `--host-discovery-script` makes the job elastic;",
           (Tests(("tests/test_docs_truth.py",), select="makes_a_job_elastic"),),
           "the launching guide says -H makes a job elastic; parse_args does not"),
    Mutant("docs_tensorflow_version_below_setup", "docs/versions.md",
           "| TensorFlow >= 2.21 |", "| TensorFlow >= 2.16 |",
           (Tests(("tests/test_docs_truth.py",), select="version_claims and versions"),),
           "the supported-versions page claims an older TensorFlow than setup.py requires"),
    Mutant("unnamed_calls_get_fresh_names", "ringtrain/core/names.py",
           'return f"{kind}.noname.{n % UNNAMED_SLOTS}"',
           'return f"{kind}.noname.{n}"',
           (Tests((API_FORMS,), ranks=2, select="express"),),
           "every unnamed call a new name: the response cache never hits and no unnamed call is express"),
    Mutant("unnamed_slot_reused_while_in_flight", "ringtrain/engine/intake.py",
           "        if not self.names:\n            return False\n        dotted = name",
           "        if True:\n            return False\n        dotted = name",
           (Tests((API_FORMS,), ranks=2, select="slots"),),
           "an unnamed slot's name is taken again while its earlier async collective is still in flight"),
    Mutant("deferred_async_waits_for_its_wait", "ringtrain/engine/engine.py",
           "        if self.intake.deferred is not None:\n            self.intake.flush()\n        busy = self._take_submissions()",
           "        busy = self._take_submissions()",
           (Tests((API_FORMS,), ranks=2, select="never_waited"),),
           "a held-back async allreduce starts only at its own wait: a peer waits as long as this rank computes"),
    Mutant("polled_async_never_starts", "ringtrain/engine/intake.py",
           "        if self.deferred is None:\n            return\n        with self.lock:\n"
           "            request, self.deferred",
           "        if True:\n            return\n        with self.lock:\n"
           "            request, self.deferred",
           (Tests((API_FORMS,), ranks=2, select="never_waited"),),
           "a held-back async allreduce is never handed to the engine: only its own wait() runs it"),
    Mutant("held_async_keeps_its_name_in_flight", "ringtrain/engine/engine.py",
           "            intake.names.discard(name)      # (one atomic set operation: no lock needed to drop our own name)\n",
           "",
           (Tests((API_FORMS,), ranks=2, select="name_in_flight"),),
           "a held-back async allreduce run by its wait leaves its name in flight: the name can never be used again"),
    Mutant("held_async_returns_its_input", "ringtrain/engine/engine.py",
           "            held._result = held.out\n",
           "            held._result = held.array\n",
           (Tests((API_FORMS,), ranks=2, select="name_in_flight"),),
           "a held-back out-of-place async allreduce returns its input, not the reduced result"),
    Mutant("native_reduce_starts_from_its_own_rank", "csrc/express_cycle.c",
           "        data[p] = (char *)slot + ctx->header_bytes;",
           "        data[(p - rank + size) % size] = (char *)slot + ctx->header_bytes;",
           (Tests((NATIVE_CYCLE,)),),
           "the native cycle reduces the slots starting from its own: ranks add in different orders and their "
           "float results differ in the last bits"),
    Mutant("native_ignores_a_peers_flag", "csrc/express_cycle.c",
           "        if (h[1] != 0 || !(b[word] & bit)",
           "        if (!(b[word] & bit)",
           (Tests((NATIVE_CYCLE,)),),
           "the native cycle reduces even when a peer flagged the cycle (it wants the coordinator): that rank runs "
           "a slow cycle while this one goes on"),
    Mutant("native_reads_the_other_parity", "csrc/express_cycle.c",
           "        const char *slot = ctx->slots[p][parity];",
           "        const char *slot = ctx->slots[p][p == rank ? parity : parity ^ 1];",
           (Tests((NATIVE_CYCLE,)),),
           "the native cycle reads a peer's slot of the previous cycle: stale data reduced"),
    Mutant("native_average_ignores_the_postscale", "ringtrain/engine/native_cycle.py",
           "    return (code * 2 + 1, scale, 1)",
           "    return (code * 2 + 1, 1.0 / size, 1)",
           (Tests((NATIVE_CYCLE,)),),
           "the native reduce scales by 1/N only: Average with a postscale (and a postscaled Sum) come out wrong"),
    Mutant("native_takes_a_strided_array", "ringtrain/engine/cycle_agreement.py",
           "self._native is not None and array.flags.c_contiguous and out.flags.c_contiguous:",
           "self._native is not None:",
           (Tests((NATIVE_CYCLE_JOB,), ranks=2, select="strided"),),
           "a strided output goes to the native call, which writes contiguous bytes"),
    Mutant("group_meta_cache_forgets_the_op", "ringtrain/core/collectives.py",
           "    key = (int(op), dtype, device, float(prescale_factor), float(postscale_factor), sizes)",
           "    key = (0, dtype, device, float(prescale_factor), float(postscale_factor), sizes)",
           (Tests((NATIVE_CYCLE_JOB,), ranks=2, select="grouped"),),
           "grouped calls of one shape share one Meta whatever their op: a Sum after an Average comes out averaged"),
    Mutant("memo_keeps_a_stale_cache_id", "ringtrain/engine/cycle_agreement.py",
           "            if plan.generation != self.cache.updates:\n                self._read_plan(plan)",
           "            if plan.generation < 0:\n                self._read_plan(plan)",
           (Tests((CHURN,), ranks=2, select="eviction_of_their"),),
           "an express plan keeps the cache id it first read: after an eviction it names another collective's id"),
    Mutant("memo_keyed_without_dtype", "ringtrain/core/collectives.py",
           "    key = (name, op, array.dtype, array.shape, float(prescale_factor), float(postscale_factor))",
           "    key = (name, op, array.shape, float(prescale_factor), float(postscale_factor))",
           (Tests((API_FORMS,), ranks=2, select="one_name"),),
           "a float64 call reuses the plan of a float32 call of the same name and shape: reduced as float32"),
    Mutant("memo_keyed_without_op", "ringtrain/core/collectives.py",
           "    key = (name, op, array.dtype, array.shape, float(prescale_factor), float(postscale_factor))",
           "    key = (name, array.dtype, array.shape, float(prescale_factor), float(postscale_factor))",
           (Tests((API_FORMS,), ranks=2, select="one_name"),),
           "an Average call reuses the plan of a Sum call of the same name and array: the result is not averaged"),
    Mutant("memo_keyed_without_the_postscale", "ringtrain/core/collectives.py",
           "    key = (name, op, float(prescale_factor), float(postscale_factor), signature)",
           "    key = (name, op, float(prescale_factor), signature)",
           (Tests((API_FORMS,), ranks=2, select="one_name"),),
           "a grouped call reuses the plan of the same group with another postscale: scaled by the old factor"),
    Mutant("group_plan_lays_every_array_at_the_start", "ringtrain/core/collectives.py",
           "        layout.append((slice(offset, offset + a.size), a.shape))",
           "        layout.append((slice(0, a.size), a.shape))",
           (Tests((API_FORMS,), ranks=2, select="independent"),),
           "a recurring group's results are all read from the start of the packed array"),
    Mutant("group_plan_packs_every_group_flat", "ringtrain/engine/express_memo.py",
           "        self.flat = group is not None and all([shape is None for _, shape in group])",
           "        self.flat = group is not None",
           (Tests((API_FORMS,), ranks=2, select="independent"),),
           "a recurring group of 2-D and 3-D arrays is packed along dim 0 as if every array were 1-D"),
    Mutant("torch_group_skips_the_contiguity_check", "ringtrain/torch/functions.py",
           "        if not a.flags.c_contiguous:\n            return None\n",
           "        pass\n",
           (Tests((API_FORMS,), ranks=2, select="strided"),),
           "a grouped allreduce of non-contiguous torch tensors hands their strided views to the core"),
    Mutant("memo_grows_without_bound", "ringtrain/engine/express_memo.py",
           "        if len(self.plans) >= self.capacity:\n            self.plans.clear()",
           "        if False:\n            self.plans.clear()",
           (Tests(("tests/test_negotiation.py",), select="memo"),),
           "a job that keeps inventing names grows the express memo forever"),
    Mutant("express_ignores_the_prescale", "ringtrain/engine/model.py",
           'return meta.kind == "allreduce" and meta.device == "cpu" and meta.scales[0] == 1.0',
           'return meta.kind == "allreduce" and meta.device == "cpu"',
           (Tests(("tests/parallel/test_collectives.py",), ranks=2),),
           "the one fast-path rule lets a prescaled allreduce through; the express paths cannot apply it"),
    Mutant("stall_leftovers_stay_in_the_book", "ringtrain/engine/negotiation.py",
           "        for name in names:\n            del self.pending[name]\n",
           "        for name in names:\n            pass\n",
           (Tests(("tests/test_faults.py",), select="stall_leaves and numpy and 2"),),
           "a stall fails the stalled collectives but rank 0's book keeps them: the next stall check ends them "
           "again while the other side's names never end"),
    Mutant("a_stall_fails_the_whole_engine", "ringtrain/engine/engine.py",
           "                if not held and action.error == \"StallError\":",
           "                if action.error == \"StallError\":\n"
           "                    self._fail(errors.StallError(action.message))\n"
           "                if not held and action.error == \"StallError\":",
           (Tests(("tests/test_faults.py",), select="stall_leaves and numpy and 2"),),
           "a stall poisons every later collective of the job (as before stalls left the job usable)"),
    Mutant("a_stall_ends_both_sides_at_once", "ringtrain/engine/negotiation.py",
           "names = tuple(name for name, _ in stalled if set(self.pending[name].metas) == holders)",
           "names = tuple(name for name, _ in stalled)",
           (Tests(("tests/test_faults.py",), select="stall_leaves and numpy and 2"),),
           "a rank that skipped a collective has its next call ended too, and is one call ahead ever after"),

    Mutant("sparse_average_divides_by_the_world_in_a_set", "ringtrain/torch/functions.py",
           "    return size() if process_set is None or process_set.process_set_id == 0 else process_set.size()",
           "    return size()",
           (Tests(("tests/parallel/test_torch_api.py",), ranks=2, select="sparse_average"),),
           "a sparse gradient averaged in a process set is divided by the world's size"),
    Mutant("adasum_dot_product_per_bucket", "ringtrain/core/adasum.py",
           "counts = [arrays[i].size for i in positions]",
           "counts = [sum(arrays[i].size for i in positions)]",
           (Tests((ADASUM,), ranks=2, select="fused"),),
           "a grouped Adasum takes one dot product over the whole fused buffer instead of one per tensor"),
    Mutant("adasum_float64_sums_not_rescaled", "ringtrain/core/adasum.py",
           "if _TINY_SUM <= min(aa, bb) and max(aa, bb) <= _HUGE_SUM:",
           "if True:",
           (Tests((ADASUM,), ranks=2, select="magnitudes"),),
           "float64 squares near tiny underflow and near sqrt(max) overflow: the coefficients are wrong"),
    Mutant("adasum_optimizer_steps_alone", "ringtrain/torch/adasum_optimizer.py",
           "if deltas and state.process_set.included() is not False:",
           "if False:",
           (Tests((ADASUM,), ranks=2, select="distributed_optimizer"),),
           "the Adasum optimizer applies each rank's own step and never combines them"),
    Mutant("keras_adasum_packed_into_one_buffer", "ringtrain/tensorflow/gradients.py",
           "if not all(isinstance(a, np.ndarray) for a in host) or reducer.scaling.op is Adasum:",
           "if not all(isinstance(a, np.ndarray) for a in host):",
           (Tests(("tests/parallel_tf/test_tf_adasum.py",), ranks=2, select="keras"),),
           "keras packs a bucket's gradients into one shared buffer: Adasum's dot product is per bucket"),
    Mutant("jax_adasum_bucket_packed", "ringtrain/jax/optimizer.py",
           "if outputs is None and self.reducer.scaling.op is Adasum:",
           "if False:",
           (Tests(("tests/parallel_jax/test_jax_adasum.py",), ranks=2, select="optimizer"),),
           "the JAX optimizer packs a bucket into one buffer: Adasum's dot product is per bucket"),
    Mutant("mixed_group_results_by_position_in_part", "ringtrain/core/group_handles.py",
           "for i, r in zip(positions, handle.wait(timeout)):",
           "for i, r in enumerate(handle.wait(timeout)):",
           (Tests((GROUPED_EXPRESS,), ranks=2, select="mixed_dtypes"),),
           "a grouped allreduce of several dtypes returns each dtype's results at the front of the list"),
    Mutant("best_model_checkpoint_written_by_every_rank", "ringtrain/keras/callbacks.py",
           "        if functions.rank() == 0:\n            super()._save_model(epoch, batch, logs)",
           "        super()._save_model(epoch, batch, logs)",
           (Tests(("tests/parallel_tf/test_keras_checkpoints.py",), ranks=2, select="best_model"),),
           "every rank writes the best-model checkpoint (ranks race on one file, or litter theirs)"),
    Mutant("keras_load_model_without_the_distributed_optimizer", "ringtrain/keras/optimizer.py",
           "return keras.models.load_model(filepath, custom_objects=objects)",
           "return keras.models.load_model(filepath, custom_objects=custom_objects)",
           (Tests(("tests/parallel_tf/test_keras_checkpoints.py",), ranks=2, select="load_model"),),
           "load_model gives back the plain optimizer: the loaded model trains on each rank's gradients alone"),
    Mutant("tf_sync_batch_norm_statistics_stay_local", "ringtrain/tensorflow/sync_batch_norm.py",
           "total, squares, count = functions.grouped_allreduce(local, op=functions.Sum, process_set=self._process_set)",
           "total, squares, count = local",
           (Tests(("tests/parallel_tf/test_tf_sync_batch_norm.py",), ranks=2),),
           "SyncBatchNormalization normalises by each rank's own batch statistics"),
    Mutant("non_contiguous_in_place_result_not_copied_back", "ringtrain/torch/functions.py",
           "    if work is not tensor:\n        with torch.no_grad():",
           "    if work is not tensor and False:\n        with torch.no_grad():",
           (Tests(("tests/parallel/test_torch_api.py",), ranks=2, select="non_contiguous"),),
           "an in-place allreduce of a non-contiguous tensor reduces a copy and leaves the tensor as it was"),
    # modules that had none: a build that hides the compiler's failure, one that rebuilds over a peer's library
    Mutant("csrc_failed_compile_not_raised", "ringtrain/csrc.py",
           "            if done.returncode != 0:\n",
           "            if done.returncode != 0 and False:\n",
           (Tests(("tests/test_csrc_build.py",)),),
           "a compiler failure is not raised: an empty file is installed as the library"),
    Mutant("csrc_rebuilds_over_a_peers_library", "ringtrain/csrc.py",
           "        if os.path.exists(target):            # a peer built it while we waited\n            return\n",
           "",
           (Tests(("tests/test_csrc_build.py",)),),
           "every rank compiles again after the lock, over the library a peer has loaded"),
    Mutant("csrc_library_name_ignores_the_source", "ringtrain/csrc.py",
           '"\\0".join([text, sys.platform, *key, *command])',
           '"\\0".join([sys.platform, *key, *command])',
           (Tests(("tests/test_csrc_build.py",)),),
           "an edited source (an upgrade's, or a planted C bug) loads the old cached library"),
    Mutant("nccl_built_without_a_gpu_imports_cupy", "ringtrain/core/build_info.py",
           "    if not cuda_built():\n        return False\n", "",
           (Tests(("tests/parallel/test_torch_api.py",), ranks=2, select="queries_and_horovod_internal_error"),),
           "nccl_built() on a machine without a GPU imports cupy's NCCL (ImportError) instead of answering False"),
    Mutant("elastic_worker_ignores_its_slot_for_the_gpu", "ringtrain/core/state.py",
           "    return local_rank if slot is None else slot\n", "    return local_rank\n",
           (Tests((ELASTIC_PIECES,), select="binds_the_gpu_of_its_slot"),),
           "every elastic worker is local rank 0 of its own world: all bind GPU 0"),
    Mutant("add_process_set_skips_the_agreement", "ringtrain/core/process_sets.py",
           '    everyone = allgather_object(ranks, name=f"add_process_set.{set_registry.next_id()}")\n',
           "    everyone = [ranks] * world.Get_size()\n",
           (Tests(("tests/parallel/test_process_sets.py",), ranks=2, select="collective_and_checked"),),
           "ranks asking for different sets are not compared: the communicator split builds different sets"),
    Mutant("handle_wait_swallows_the_error", "ringtrain/engine/handle.py",
           "        if self._error is not None:\n            raise self._error\n",
           "        if self._error is not None and False:\n            raise self._error\n",
           (Tests((API_FORMS,), ranks=2, select="mismatch_in_an_unnamed_call"),),
           "wait() returns None for a collective that failed instead of raising its error"),
    Mutant("joined_rank_contributes_stale_staging", "ringtrain/engine/fusion.py",
           "                staging[offset:offset + src] = 0\n", "                pass\n",
           (Tests(("tests/parallel/test_join.py",), ranks=2),),
           "a rank that joined sends whatever the staging buffer held instead of zeros"),
    Mutant("rank_zero_only_on_every_rank", "ringtrain/keras/rank_zero.py",
           "    return list(callbacks) if _rank() == 0 else []\n", "    return list(callbacks)\n",
           (Tests(("tests/parallel_tf/test_tf_training.py",), ranks=2, select="only_rank_zero_writes"),),
           "every rank writes the checkpoint: N writers race on one file"),
    Mutant("warmup_ramps_to_size_plus_one", "ringtrain/keras/callbacks.py",
           "            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)\n",
           "            return 1.0 / size * (epoch * size / warmup_epochs + 1)\n",
           (Tests(("tests/parallel_tf/test_tf_training.py",), ranks=2, select="warmup"),),
           "the warmup ends at lr * (size + 1) / size instead of lr"),
    Mutant("spark_blames_rank_zero", "ringtrain/launch/spark.py",
           "            raise RankFailedError(int(found.group(1)), found.group(2)",
           "            raise RankFailedError(0, found.group(2)",
           (Tests(("tests/test_spark_ray.py",), select="failing and spark"),),
           "a failed Spark job blames rank 0 whichever rank failed"),
    Mutant("ray_blames_rank_zero", "ringtrain/launch/ray.py",
           "                    raise RankFailedError(int(found.group(1)), found.group(2)",
           "                    raise RankFailedError(0, found.group(2)",
           (Tests(("tests/test_spark_ray.py",), select="failing and ray"),),
           "a failed Ray job blames rank 0 whichever rank failed"),
    Mutant("task_worker_drops_the_error", "ringtrain/launch/task_worker.py",
           '        _write(result_path, ("error", text))\n', "",
           (Tests(("tests/test_spark_ray.py",), select="failing and spark"),),
           "a rank whose function raised reports nothing to the driver: the error text is lost"),
    # JAX: a jit allgather that lets different row counts through, a broadcast gradient on the wrong rank, the
    # alltoall return convention, the FFI handler's build and its error path and in-place aliases
    Mutant("jax_jit_allgather_accepts_different_rows", "ringtrain/jax/allgather.py",
           "    if np.array_equal(rows_by_rank, expected):\n        return\n",
           "    if True:\n        return\n",
           (Tests(("tests/parallel_jax/test_jax_errors.py",), ranks=2, select="different_rows"),),
           "under jit, ranks with different dim 0 are not refused: the traced shape is wrong on some rank"),
    Mutant("jax_broadcast_gradient_on_rank_zero", "ringtrain/jax/broadcast.py",
           "    return gradients.backward(\"broadcast\", cotangents, spec, root_rank=spec.root_rank)\n",
           "    return gradients.backward(\"broadcast\", cotangents, spec, root_rank=0)\n",
           (Tests(("tests/parallel_jax/test_jax_gradients.py",), ranks=2, select="broadcast_gradient"),),
           "the broadcast's gradient lands on rank 0 whatever the root"),
    Mutant("jax_alltoall_without_splits_returns_a_pair", "ringtrain/jax/alltoall.py",
           "    if splits is None:\n        return arrays.to_jax(received)\n",
           "    if False:\n        return arrays.to_jax(received)\n",
           (Tests(("tests/parallel_jax/test_jax_collectives.py",), ranks=2, select="alltoall"),),
           "eager alltoall without splits returns (array, splits) instead of the array (Horovod's convention)"),
    Mutant("jax_ffi_built_as_cxx11", "ringtrain/jax/ffi_build.py",
           '["-O2", "-std=c++17",', '["-O2", "-std=c++11",',
           (Tests(("tests/test_jax_host_call.py",), select="builds_where_a_compiler"),),
           "the XLA FFI headers need C++17: the build fails and every call falls back to Python host callbacks"),
    Mutant("jax_ffi_host_error_reported_as_success", "ringtrain/jax/ffi_target.py",
           "        ctypes.memmove(error, message, len(message))\n        return 1\n",
           "        ctypes.memmove(error, message, len(message))\n        return 0\n",
           (Tests(("tests/test_jax_host_call.py",), select="error_on_the_host"),),
           "an exception in a collective is swallowed under the FFI lowering: the caller gets unwritten buffers"),
    Mutant("jax_ffi_in_place_without_aliases", "ringtrain/jax/ffi_target.py",
           "    aliases = {i: i for i in range(in_place)}\n", "    aliases = {}\n",
           (Tests(("tests/test_jax_host_call.py",), select="in_place_results"),),
           "in-place collectives get fresh output buffers: a copy per call"),
    # TensorFlow: the XLA guard, prescaling while staging, PartialDistributedGradientTape's local scaling, bfloat16
    Mutant("tf_collective_traced_under_xla_not_refused", "ringtrain/tensorflow/xla.py",
           "    if in_xla_context():\n", "    if False:\n",
           (Tests(("tests/parallel_tf/test_tf_training.py",), ranks=2, select="xla"),),
           "a collective inside jit_compile=True fails later with TensorFlow's PyFunc error, not ours with the fix"),
    Mutant("tf_shared_bucket_drops_the_prescale", "ringtrain/tensorflow/shared_buckets.py",
           "            np.multiply(array, prescale_factor, out=view)\n", "            view[...] = array\n",
           (Tests(("tests/parallel_tf/test_tf_training.py",), ranks=2, select="predivide"),),
           "gradient_predivide_factor is not applied while staging Keras gradients (the sum is too large)"),
    Mutant("tf_partial_tape_leaves_local_gradients_unscaled", "ringtrain/tensorflow/gradient_tape.py",
           "    return [g / tf.cast(set_size, g.dtype) if local",
           "    return [g if local",
           (Tests(("tests/parallel_tf/test_tf_horovod_names.py",), ranks=2,
                  select="partial_distributed_gradient_tape"),),
           "scale_local_gradients=True leaves the local layers' gradients N times too large"),
    Mutant("tf_bfloat16_viewed_as_float16", "ringtrain/tensorflow/arrays.py",
           "        return np.from_dlpack(tf.bitcast(tensor, tf.int16)).view(_BFLOAT16)\n",
           "        return np.from_dlpack(tf.bitcast(tensor, tf.int16)).view(np.float16)\n",
           (Tests(("tests/parallel_tf/test_tf_collectives.py",), ranks=2,
                  select="allreduce_every_dtype and bfloat16"),),
           "bfloat16 tensors are read as float16: every reduction of them is garbage"),
    Mutant("tf_elastic_state_sync_skips_the_optimizer", "ringtrain/tensorflow/elastic.py",
           "        return self.variables + _optimizer_variables(self.optimizer)\n",
           "        return self.variables\n",
           (Tests(("tests/parallel_tf/test_tf_elastic_state.py",), ranks=2, select="lossless"),),
           "TensorFlowState(optimizer=) hands over the variables but not the optimizer's (momentum, iterations): "
           "after a re-form the ranks step on with different momenta and step counts"),
    Mutant("tf_gradient_aggregation_applies_every_call", "ringtrain/tensorflow/gradient_aggregation.py",
           "        return tf.cond(tf.equal(self.counter, 0), apply, count_only)\n",
           "        return tf.cond(tf.constant(True), apply, count_only)\n",
           (Tests(("tests/parallel_tf/test_tf_horovod_names.py",), ranks=2, select="aggregation"),),
           "LocalGradientAggregationHelper applies the optimizer on every call, also with the unreduced local "
           "gradients of the passes in between"),
    # the last three modules: TF's sparse Average, the TF2 optimizer's hand-over, JAX's compression round trip
    Mutant("tf_indexed_slices_average_not_divided", "ringtrain/tensorflow/functions.py",
           "    if op == Average:\n        values = values / tf.cast(process_set.size(), values.dtype)\n",
           "    if False:\n        values = values / tf.cast(process_set.size(), values.dtype)\n",
           (Tests(("tests/parallel_tf/test_tf_collectives.py",), ranks=2, select="indexed_slices_are_gathered"),),
           "an Average of tf.IndexedSlices returns the gathered sum: sparse gradients N times too large"),
    Mutant("stream_reduce_push_skips_the_scale", "csrc/stream_copy.c",
           "            if (scaled) acc = MUL(acc, vf);",
           "            if (0) acc = MUL(acc, vf);",
           (Tests(("tests/test_stream_copy.py",)),),
           "the streamed reduce leaves out the postscale in its vector loop: an out-of-place Average of 4 MB and "
           "more comes out summed"),
    Mutant("stream_copy_drops_the_tail", "csrc/stream_copy.c",
           "    memcpy(dst + 128 * blocks, src + 128 * blocks, n - 128 * blocks);",
           "",
           (Tests(("tests/test_stream_copy.py",)),),
           "the stream copy forgets the bytes past its last 128-byte block: a result's last elements stay garbage"),
    Mutant("stream_copy_takes_any_dtype", "ringtrain/stream_copy.py",
           "    return dtype in _KINDS",
           "    return True",
           (Tests(("tests/test_stream_copy.py",)),),
           "int32 results go to the float kernel: a KeyError, or float adds of integer bits"),
    Mutant("shm_streamed_copy_out_reads_the_wrong_block", "ringtrain/transports/shm.py",
           "                            stream_copy.copy(mine(p, out), region(r, p, _PRIVATE))",
           "                            stream_copy.copy(mine(p, out), mine(p, own_input))",
           (Tests(("tests/parallel/test_transports.py",), ranks=2, select="streamed"),),
           "a streamed out-of-place allreduce copies the peers' blocks from its own input instead of the reduced "
           "blocks they pushed"),
    Mutant("tf_distributed_optimizer_takes_tf1_optimizers", "ringtrain/tensorflow/optimizer.py",
           "    if isinstance(optimizer, tf.compat.v1.train.Optimizer):\n",
           "    if False:\n",
           (Tests(("tests/parallel_tf/test_tf_horovod_names.py",), ranks=2,
                  select="hands_keras_optimizers_to_the_keras_binding"),),
           "a TF1 optimizer goes to the Keras binding and fails there with an unrelated error"),
    Mutant("jax_allreduce_returns_the_compressed_dtype", "ringtrain/jax/allreduce.py",
           "    return compression.decompress(reduced, ctx) if compression is not None else reduced\n",
           "    return reduced\n",
           (Tests(("tests/parallel_jax/test_jax_collectives.py",), ranks=2, select="compressed_allreduce"),),
           "allreduce(compression=fp16) hands back float16 arrays instead of the caller's dtype"),
    Mutant("solo_express_ignores_the_postscale", "ringtrain/engine/executor.py",
           '_solo((array,), (out,), action.prescale * action.scale, ops_for("cpu"))',
           '_solo((array,), (out,), action.prescale, ops_for("cpu"))',
           (Tests(("tests/test_single_rank.py",), select="bit_for_bit"),),
           "a one-rank allreduce on the express path drops the postscale"),
    Mutant("solo_average_divides_by_two", "ringtrain/engine/solo.py",
           'Collective.of("allreduce", (name,), (meta,), 1)',
           'Collective.of("allreduce", (name,), (meta,), 2)',
           (Tests(("tests/test_single_rank.py",), select="bit_for_bit"),),
           "a one-rank express Average divides by two"),
    Mutant("one_rank_gets_the_coordinator_protocol", "ringtrain/engine/agreement.py",
           "        return SoloAgreement(control, config, watchdog, capacity)",
           "        return CoordinatorAgreement(control, config, watchdog, capacity)",
           (Tests(("tests/test_single_rank.py",), select="bit_for_bit"),),
           "a one-rank communicator gets the Coordinator's protocol: every allreduce pays a pass, none is express"),
    Mutant("coordinator_answers_only_itself", "ringtrain/engine/coordinator_agreement.py",
           "                for r in range(1, self.size):\n",
           "                for r in range(1, 1):\n",
           (Tests(("tests/parallel/test_name_churn.py",), ranks=2, select="coordinator_protocol"),),
           "rank 0 keeps the coordinator's actions to itself: the other ranks never run a collective"),
    Mutant("submission_takes_a_strided_array", "ringtrain/core/submission.py",
           "    if not array.flags.c_contiguous:\n        raise ValueError(f\"{what % what_args}",
           "    if False:\n        raise ValueError(f\"{what % what_args}",
           (Tests(("tests/parallel/test_collectives.py",), ranks=2, select="bad_input_is_local and shm"),),
           "a strided array reaches the engine instead of a ValueError naming the call on the rank that passed it"),
    Mutant("watchdog_sleeps_a_millisecond_after_the_yields", "ringtrain/engine/watchdog.py",
           "time.sleep(min(SLEEP_CAP_S, max(SLEEP_MIN_S, waited * SLEEP_SHARE)))",
           "time.sleep(min(1e-3, 1e-6 * spins))",
           (Tests(("tests/test_watchdog.py",), select="share_of_the_time"),),
           "a wait's first sleep after its polls is ~1 ms: a peer arriving just after pays up to that much more"),
]


# Modules with no planted bug, and why. Every module under ringtrain/ has a mutant above or a line here
# (tests/test_mutants.py checks it), so a new module needs one or the other.
WITHOUT_MUTANT = {
    # faces and package files: they only re-export or say what a folder holds
    "ringtrain/__init__.py": "face", "ringtrain/__main__.py": "face", "ringtrain/spark.py": "face",
    "ringtrain/ray.py": "face", "ringtrain/core/__init__.py": "package", "ringtrain/engine/__init__.py": "package",
    "ringtrain/launch/__init__.py": "package", "ringtrain/reducer/__init__.py": "package",
    "ringtrain/world/__init__.py": "package", "ringtrain/elastic/__init__.py": "face",
    "ringtrain/jax/__init__.py": "face", "ringtrain/keras/__init__.py": "face", "ringtrain/keras/elastic.py": "face",
    "ringtrain/tensorflow/__init__.py": "face", "ringtrain/torch/__init__.py": "face",
    "ringtrain/torch/elastic.py": "face", "ringtrain/torch/mpi_ops.py": "face (Horovod's import path)",
    "ringtrain/tensorflow/mpi_ops.py": "face (Horovod's import path)", "ringtrain/transports/__init__.py": "a table",
    # data: definitions without branches
    "ringtrain/errors.py": "exception classes", "ringtrain/engine/request.py": "a record",
    "ringtrain/reducer/wrapping.py": "one class factory (isinstance checks cover it in every binding's tests)",
    "ringtrain/torch/shared.py": "one helper that allocates a shared tensor",
    "ringtrain/core/shared_arrays.py": "one allocator (its tests run on every transport)",
    "ringtrain/launch/child.py": "one prctl call", "ringtrain/world/dynamic.py": "three MPI calls in a row",
    "ringtrain/jax/compression.py": "two one-line casts", "ringtrain/tensorflow/compression.py": "two one-line casts",
    "ringtrain/jax/naming.py": "one call of core.names",
    # GPU only: their tests skip without a GPU, so a planted bug cannot be caught on CI's machine
    "ringtrain/kernels.py": "GPU only", "ringtrain/transports/cuda_ipc.py": "GPU only",
    "ringtrain/transports/nccl.py": "GPU only", "ringtrain/transports/staged.py": "GPU only",
}
# Modules with logic that still lack a planted bug: the next ones to plant. The list may only shrink.
NOT_YET = []

def copy_repo(destination):
    shutil.copytree(REPO, destination, ignore=COPY_IGNORE, symlinks=True)


def apply(mutant, root):
    """Plant the mutant in the tree at root. Returns '' or why it cannot be planted (STALE / INVALID)."""
    path = os.path.join(root, mutant.path)
    if not os.path.exists(path):
        return f"STALE: {mutant.path} does not exist"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    count = text.count(mutant.old)
    if count != 1:
        return f"STALE: the target text occurs {count} times in {mutant.path}, expected once"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mutant.old, mutant.new))
    if path.endswith(".py"):
        try:
            py_compile.compile(path, doraise=True, cfile=os.path.join(tempfile.gettempdir(), "mutant-check.pyc"))
        except py_compile.PyCompileError as error:
            return f"INVALID: the mutated file does not compile: {error.msg.strip().splitlines()[-1]}"
    return ""


def find_mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def command(tests):
    pytest = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout=120", *tests.paths]
    if tests.select:
        pytest += ["-k", tests.select]
    if not tests.ranks:
        return [sys.executable, *pytest]
    # the plugin tests/test_parallel.py gives every job: a rank in a world of the wrong size ends at once
    return [find_mpiexec(), "-n", str(tests.ranks), sys.executable, "-m", "mpi4py", *pytest, "--with-mpi",
            "-p", "mpi_job_report"]


def run_tests(tests, root):
    """(passed, seconds, output tail) of one test command run in the tree at root."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]), OMP_NUM_THREADS="1",
               RINGTRAIN_STALL_TIMEOUT_S="30", RINGTRAIN_MUTANT_ROOT=root)
    if tests.ranks:
        env["RINGTRAIN_TEST_WORLD_SIZE"] = str(tests.ranks)
    env.update(tests.env)
    start = time.monotonic()
    proc = subprocess.Popen(command(tests), cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        passed = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += ("\n" + KILLED % JOB_TIMEOUT_S).encode()
        passed = False
    kill_leftovers(root)
    return passed, time.monotonic() - start, output.decode(errors="replace")[-3000:]


def kill_leftovers(root):
    """SIGKILL every process still running from the job at root: an elastic job's driver and workers run in sessions
    of their own, so killing the job's process group leaves them behind. They all inherit RINGTRAIN_MUTANT_ROOT."""
    marker = f"RINGTRAIN_MUTANT_ROOT={root}\0".encode()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read() + b"\0":
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def check_imports_from(root):
    """The copy, not an installed ringtrain, must be what the tests import."""
    out = subprocess.run([sys.executable, "-c", "import ringtrain; print(ringtrain.__file__)"], cwd=root,
                         env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True, check=True).stdout
    if not os.path.realpath(out.strip()).startswith(os.path.realpath(root)):
        raise SystemExit(f"tests in {root} would import ringtrain from {out.strip()}; cannot mutate")


def run_mutant(mutant, verbose):
    with tempfile.TemporaryDirectory(prefix="ringtrain-mutant-") as scratch:
        root = os.path.join(scratch, "repo")
        copy_repo(root)
        problem = apply(mutant, root)
        if problem:
            return problem.split(":")[0], problem, 0.0
        total = 0.0
        for tests in mutant.tests:
            passed, seconds, output = run_tests(tests, root)
            total += seconds
            if not passed:
                if verbose:
                    print(output)
                # a job killed at JOB_TIMEOUT_S may be the mutant's hang or a loaded machine: say which it was
                how = " (the job's timeout: rerun on a quiet machine to tell a hang from load)" \
                    if output.endswith(KILLED % JOB_TIMEOUT_S) else ""
                return "CAUGHT", f"by {tests.describe()}{how}", total
        return "SURVIVED", "no test failed: " + "; ".join(t.describe() for t in mutant.tests), total


def run_baseline(mutants):
    """Every distinct test command once on the unmutated copy: a failure here would make every mutant 'caught'."""
    with tempfile.TemporaryDirectory(prefix="ringtrain-mutant-baseline-") as scratch:
        root = os.path.join(scratch, "repo")
        copy_repo(root)
        check_imports_from(root)
        failed = []
        for tests in dict.fromkeys(t for m in mutants for t in m.tests):
            passed, seconds, output = run_tests(tests, root)
            print(f"  baseline {'ok    ' if passed else 'FAILED'} {seconds:5.1f} s  {tests.describe()}", flush=True)
            if not passed:
                failed.append((tests, output))
        return failed


def sample(mutants, count, seed, budget_s):
    """Up to `count` mutants in an order fixed by `seed` (the commit in CI), skipping those whose estimated cost
    would pass the budget (at least one is always chosen). A different seed picks others."""
    ordered = sorted(mutants, key=lambda m: hashlib.sha256(f"{seed}:{m.name}".encode()).hexdigest())
    chosen, cost = [], 0.0
    for m in ordered:
        estimate = sum(60.0 if t.ranks else 20.0 for t in m.tests)     # seconds, pessimistic, on 2 cores
        if len(chosen) < count and cost + estimate <= budget_s:
            chosen.append(m)
            cost += estimate
    return chosen or ordered[:1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", default="", help="only mutants whose name contains this (a|b: either)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests without a mutant first")
    parser.add_argument("--sample", type=int, default=0, help="run only this many, chosen by --seed")
    parser.add_argument("--seed", default="", help="what chooses the sample (CI passes the commit)")
    parser.add_argument("--budget", type=float, default=120.0, help="the sample's estimated seconds, at most")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the failing output of caught mutants")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if any(part in m.name for part in args.select.split("|"))]
    if args.sample:
        mutants = sample(mutants, args.sample, args.seed, args.budget)
    if args.list:
        for m in mutants:
            print(f"{m.name:40} {m.path:32} {'; '.join(t.describe() for t in m.tests)}")
        return 0
    if not args.no_baseline:
        print("tests without a mutant:", flush=True)
        failed = run_baseline(mutants)
        if failed:
            for tests, output in failed:
                print(f"\nBASELINE: {tests.describe()} fails without any mutant:\n{output}")
            return 2
    print(f"\n{'mutant':40} {'result':9} {'time':>7}  detail", flush=True)
    results = []
    for m in mutants:
        status, detail, seconds = run_mutant(m, args.verbose)
        results.append(status)
        print(f"{m.name:40} {status:9} {seconds:6.1f}s  {detail}", flush=True)
    bad = [s for s in results if s != "CAUGHT"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutants caught"
          + (f"; {len(bad)} not ({', '.join(sorted(set(bad)))})" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
