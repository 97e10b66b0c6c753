"""hvd.LocalGradientAggregationHelper: Horovod's helper that aggregates gradients locally over
`backward_passes_per_step` calls and allreduces them once, on the last call of each period.

    helper = hvd.LocalGradientAggregationHelper(
        backward_passes_per_step=4, allreduce_func=lambda grads, vars: [hvd.allreduce(g) for g in grads],
        sparse_as_dense=True, average_aggregated_gradients=True, rank=hvd.rank(),
        optimizer_type=hvd.LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS)
    grads = helper.compute_gradients(grads, variables)
    pairs = list(zip(grads, variables))
    helper.apply_gradients(lambda: optimizer.apply_gradients(pairs), optimizer, pairs)

compute_gradients adds each gradient to a local sum (a tf.Variable per gradient); on every
`backward_passes_per_step`-th call it hands the sums to `allreduce_func(grads, vars)` (except those of variables
registered with register_local_var, divided by the set's size when scale_local_gradients), divides by
backward_passes_per_step when average_aggregated_gradients, clears the sums and returns the results; on the other
calls it returns the gradients it was given. apply_gradients runs the closure only after a call that reduced (the
counter is back at 0) and otherwise adds 1 to the optimizer's `iterations` (and to a `global_step=` keyword), so the
optimizer counts every call. Eager TensorFlow 2, eagerly or inside tf.function (Horovod's graph-mode class has the
same arguments; `rank` and `optimizer_type` are accepted and not needed). A None gradient stays None.
"""
import tensorflow as tf

from .functions import global_process_set


class LocalGradientAggregationHelper:
    """Aggregates gradients locally over `backward_passes_per_step` calls of compute_gradients() and allreduces the
    sums once, on the last call of each period; apply_gradients() applies only after a call that reduced (the
    module's docstring has the whole contract)."""
    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, backward_passes_per_step, allreduce_func, sparse_as_dense, average_aggregated_gradients,
                 rank=None, optimizer_type=None, process_set=global_process_set, scale_local_gradients=True,
                 name=""):
        if int(backward_passes_per_step) <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.rank = rank
        self.optimizer_type = optimizer_type
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.name = name
        self.counter = None                     # calls since the last reduction (a tf.Variable, made on first use)
        self.locally_aggregated_grads = []      # one tf.Variable per gradient that is not None
        self.not_none_indexes = {}              # position in the gradient list -> index in locally_aggregated_grads
        self.num_none_grad_updates = 0
        self._local_vars = set()

    def register_local_var(self, var):
        """A variable whose gradient stays local (never allreduced)."""
        self._local_vars.add(var.ref())

    def _maybe_convert_grad(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                                 "`sparse_as_dense` is False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _init_aggregation_vars(self, grads, variables):
        if self.counter is not None:
            pattern = [i for i, g in enumerate(grads) if g is not None]
            if len(grads) != len(self.not_none_indexes) + self.num_none_grad_updates or \
                    pattern != sorted(self.not_none_indexes):
                raise ValueError(f"LocalGradientAggregationHelper{'(' + self.name + ')' if self.name else ''}: "
                                 f"got {len(grads)} gradients ({len(pattern)} not None), the first call "
                                 f"{len(self.not_none_indexes) + self.num_none_grad_updates} "
                                 f"({len(self.not_none_indexes)} not None)")
            return
        with tf.init_scope():           # plain variables even when first called inside a tf.function
            for idx, grad in enumerate(grads):
                if grad is None:
                    self.num_none_grad_updates += 1
                    continue
                shape = grad.shape if grad.shape.is_fully_defined() else variables[idx].shape
                self.not_none_indexes[idx] = len(self.locally_aggregated_grads)
                self.locally_aggregated_grads.append(
                    tf.Variable(tf.zeros(shape, grad.dtype), trainable=False, name=f"aggregated_grad_{idx}"))
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="aggregation_counter")

    def _reduce(self, aggregated, variables):
        """allreduce_func over the gradients of variables that are not local; local ones scaled; then divided by
        the number of passes when average_aggregated_gradients."""
        shared = [i for i, v in enumerate(variables) if v.ref() not in self._local_vars]
        reduced = list(aggregated)
        if shared:
            results = self._allreduce_grads([aggregated[i] for i in shared], [variables[i] for i in shared])
            for i, result in zip(shared, results):
                reduced[i] = result
        if self.scale_local_gradients and len(shared) < len(variables):
            size = float(self.process_set.size())
            reduced = [g if i in shared else g / size for i, g in enumerate(reduced)]
        if self.average_aggregated_gradients:
            reduced = [g / self.backward_passes_per_step for g in reduced]
        return reduced

    def compute_gradients(self, grads, vars):
        """Add `grads` to the local sums; on every backward_passes_per_step-th call return the reduced sums (and
        clear them), else `grads` as given (IndexedSlices made dense)."""
        grads, variables = list(grads), list(vars)
        if len(grads) != len(variables):
            raise ValueError(f"compute_gradients: {len(grads)} gradients for {len(variables)} variables")
        grads = [None if g is None else self._maybe_convert_grad(g) for g in grads]
        self._init_aggregation_vars(grads, variables)
        present = [g for g in grads if g is not None]
        present_vars = [v for g, v in zip(grads, variables) if g is not None]
        for aggregate, grad in zip(self.locally_aggregated_grads, present):
            aggregate.assign_add(grad)
        count = self.counter.assign_add(1)

        def reduce_and_clear():
            reduced = self._reduce([a.read_value() for a in self.locally_aggregated_grads], present_vars)
            with tf.control_dependencies([g for g in reduced]):
                for aggregate in self.locally_aggregated_grads:
                    aggregate.assign(tf.zeros_like(aggregate))
                self.counter.assign(0)
                return [tf.identity(g) for g in reduced]

        if present:
            results = tf.cond(tf.equal(count, self.backward_passes_per_step), reduce_and_clear,
                              lambda: [tf.identity(g) for g in present])
            results = list(results) if isinstance(results, (list, tuple)) else [results]
        else:
            def restart():
                self.counter.assign(0)
                return tf.constant(0)
            tf.cond(tf.equal(count, self.backward_passes_per_step), restart, lambda: tf.constant(0))
            results = []
        return [results[self.not_none_indexes[i]] if i in self.not_none_indexes else None
                for i in range(len(grads))]

    def apply_gradients(self, apply_grads_closure, optimizer, *args, **kwargs):
        """Run apply_grads_closure after a call of compute_gradients that reduced; otherwise count the step in
        `optimizer.iterations` (and kwargs['global_step']). Returns a bool tensor: whether it applied."""
        if self.counter is None:
            raise RuntimeError("LocalGradientAggregationHelper.apply_gradients before compute_gradients")
        if args and isinstance(args[0], (list, tuple)) and hasattr(optimizer, "build") and \
                not getattr(optimizer, "built", True):
            # built here, outside the conditional branch: its variables cannot be made inside a tf.cond
            optimizer.build([v for _, v in args[0]])

        def apply():
            apply_grads_closure()
            return tf.constant(True)

        def count_only():
            if getattr(optimizer, "iterations", None) is not None:
                optimizer.iterations.assign_add(1)
            if kwargs.get("global_step") is not None:
                kwargs["global_step"].assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), apply, count_only)
