"""The gradient reducer every binding shares: buckets, pass counting, scaling, compression, submission, completion.

A binding (torch, tensorflow, keras, jax, a sharded optimizer) adapts its tensors and hooks to ONE `Reducer` and does
nothing else. The reducer is framework-neutral: it never sees a torch or tf tensor except as an opaque key or as a
value it hands back to the binding, and it talks to the core API (`ringtrain.allreduce_async`, ...) in numpy or cupy
arrays. It lives beside the user's optimizer (as torch DDP's Reducer), never as attributes on it.

The interface, in the order a training step uses it:

    reducer = Reducer([Member(param, "fc1.weight", nbytes, kind=(dtype, device), host=True), ...],
                      prefix=instance_prefix("DistributedOptimizer", process_set),
                      scaling=Scaling.for_gradients(op, gradient_predivide_factor),
                      compression=Compression.fp16, process_set=process_set, passes_per_step=k,
                      bucket_bytes=25 << 20, first_bucket_bytes=1 << 20, alone_bytes=1 << 20, overlap=True)

- Registration: members are given in definition order; `reducer.buckets` is the plan (first guess: reverse
  definition order, as gradients become final in backward), `reducer.bucket_of(key)` the bucket of one member.
  `plan_buckets()` is the rule (small first bucket, then `bucket_bytes`, one kind -- dtype and device -- per bucket,
  a host member of `alone_bytes` or more alone with overlap, with other such members only after backward, up to
  `large_bucket_bytes`; reducer/buckets.py); `groups=` (Horovod's) fixes the buckets instead.
- Pass counting: the binding calls `reducer.arrived(key)` once per member per backward pass (a post-accumulate-grad
  hook); it returns the bucket when that bucket is complete -- every member arrived `passes_per_step` times -- and not
  yet submitted. `check_passes()` raises when a member arrived more often. While the phase is
  `Phase.LEARNING_ORDER` (overlap, first step) the reducer records the order gradients became final.
- Submission (the binding's launch calls it): `reducer.submit(bucket, arrays, outs=None, sync=False, done=None,
  prescaled=False)` starts the bucket's collective on the arrays (in place when `outs` is None): one array -> one allreduce, several -> one
  grouped allreduce, both named `bucket.name` with the reducer's op and scale factors (prescaled=True: the binding
  multiplied by the prescale factor while packing). sync=True runs it on the caller's thread. `done(result)` runs
  when the bucket is waited for (copy back, decompress). `track(bucket, handle, done)` adds any other handle
  (sparse gradients) to the bucket. `submit_remaining(fn, last_ready_first=False)` calls fn(bucket) for every bucket
  not yet submitted, in bucket order or its reverse.
- The step's lifecycle, the same for every binding and both sharded stages (as torch DDP's Reducer):
  `prepare_for_backward()` after the optimizer stepped; `gradient_ready(key)` from a hook while the order is being
  learned (and `trigger(bucket)`, the hook of a bucket's last-ready member after that): the complete bucket goes to
  the binding's `launch(bucket, sync)`, which hands its tensors over as arrays and calls `submit`;
  `finalize(launch_remaining=None, last_ready_first=False, after_wait=None)` checks the pass counts, launches what
  backward did not, waits for every bucket in bucket order (the same on every rank) running their `done`, learns
  the order after the first step and leaves the step synchronized -- or clean after any failure;
  `check_zero_grad()` before a zero_grad (an error while collectives still write into the gradients);
  `drop_pending()` (load_state_dict, a new pass count). Underneath: `wait()`, `drain()` (ignoring errors),
  `reset_step()`; `state` is `StepState.OPEN` until the step is synchronized.
- Re-planning: after the first step with overlap, `learn_order()` re-lays the buckets in the order gradients actually
  became final (rank 0's order, agreed by one allreduce), unless the user gave groups, and moves to
  `Phase.ORDER_KNOWN`. `last_ready(bucket)` then names the member whose hook should submit the bucket.
- Scaling: `Scaling.for_gradients(op, gradient_predivide_factor)` is Horovod's rule: Average's 1/size is applied by
  the core; a predivide factor f divides by f before the sum and multiplies by f after (fp16 sums stay in range).
  It is applied once, by the core, through the scale factors of the submitted collective.
- The communication seam: `compress(tensor)` / `decompress(tensor, ctx)` run the reducer's `hook`, a
  CommunicationHook (reducer/compression.py) made from the binding's Compressor (its cast) -- the one place where
  compression, and later hooks that change what is communicated (PowerSGD, Adasum deltas), plug in.
- Sharded optimizers: `Reducer(..., collective=Collective.REDUCESCATTER)` submits each bucket's flat array as a
  reducescatter instead; `done(result)` then receives this rank's shard of the reduced bucket (shards follow the
  core's rule: dim 0 split as evenly as possible, first ranks one row more). The parameter allgather is the
  sharded optimizer's own.
"""
import collections
import dataclasses
import enum
import itertools

import numpy as np

from ringtrain.core import collectives
from ringtrain.errors import RingtrainError
from ringtrain.ops import Average, Sum, as_allreduce_op
from ringtrain.core.process_sets import global_process_set

from .compression import CommunicationHook
from .buckets import Bucket, Member, explicit_groups, plan_buckets, split_in_groups  # noqa: F401  (re-exported)

# names stay distinct when one process wraps several optimizers; counted per process set, so an optimizer that only
# a set's members create does not shift the names of the world's next optimizer on those ranks alone
_instance_counters = collections.defaultdict(itertools.count)


def instance_prefix(kind, process_set=global_process_set):
    """The request-name prefix of a binding object of `kind` ('DistributedOptimizer'), the same on every rank that
    creates the same objects in the same order on the same process set."""
    set_id = process_set.process_set_id
    number = next(_instance_counters[(kind, set_id)])
    return f"{kind}{number}" if set_id == 0 else f"{kind}.set{set_id}.{number}"


class Collective(enum.Enum):
    ALLREDUCE = "allreduce"            # data parallel: every rank gets the whole reduced bucket
    REDUCESCATTER = "reducescatter"    # sharded optimizer: every rank gets its shard of the reduced bucket


class Phase(enum.Enum):
    LEARNING_ORDER = "learning order"  # overlap, first step: every gradient runs the hook; the ready order is recorded
    ORDER_KNOWN = "order known"        # buckets final; only each bucket's last-ready member submits it


class Layout(enum.Enum):
    GUESSED = "guessed"                # reverse definition order, until the first step shows the real one
    OBSERVED = "observed"              # re-laid in the ready order of the first step (rank 0's)
    USER_GROUPS = "user groups"        # Horovod's groups=: the user's buckets, never re-laid
    BY_SIZE = "by size"                # reduced after backward: order does not matter, small members share buckets


class StepState(enum.Enum):
    OPEN = "open"                      # gradients may still arrive / are in flight
    SYNCHRONIZED = "synchronized"      # waited for; nothing new since


@dataclasses.dataclass(frozen=True)
class Scaling:
    """The op and the scale factors a gradient collective runs with (the core applies them, once)."""
    op: object = Average
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0

    @classmethod
    def for_gradients(cls, op=Average, gradient_predivide_factor=1.0):
        """Horovod's gradient rule: predividing by f (then multiplying the sum by f, after Average's 1/size) needs
        op=Average."""
        op = as_allreduce_op(op)
        factor = float(gradient_predivide_factor)
        if factor != 1.0 and op is not Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op!r}")
        if factor == 1.0:
            return cls(op)
        return cls(op, 1.0 / factor, factor)

    def kwargs(self):
        """The scale keywords of a core collective, only those that do something."""
        scales = {}
        if self.prescale_factor != 1.0:
            scales["prescale_factor"] = self.prescale_factor
        if self.postscale_factor != 1.0:
            scales["postscale_factor"] = self.postscale_factor
        return scales

    def local_factor(self):
        """What the collective multiplies by on a set of one rank (Average's 1/size is then 1)."""
        return self.prescale_factor * self.postscale_factor


@dataclasses.dataclass(eq=False)
class Pending:
    handle: object                     # has wait() (and poll()); None for a collective already run (sync)
    done: object                       # done(result) -> None, or None


class Reducer:
    """Buckets of gradients, their pass counts and their collectives for one model on one process set (see the
    module docstring for the interface)."""

    def __init__(self, members, *, prefix, scaling=Scaling(), compression=None, process_set=global_process_set,
                 passes_per_step=1, bucket_bytes=25 << 20, first_bucket_bytes=1 << 20, alone_bytes=None,
                 large_bucket_bytes=None, overlap=True, groups=None, collective=Collective.ALLREDUCE, launch=None):
        self.members = list(members)
        self.prefix = prefix
        self.scaling = scaling
        self.compression = compression
        self.hook = CommunicationHook.of(compression)   # the seam: what a bucket's tensors become on the wire
        self.launch = launch            # the binding's launch(bucket, sync): hand the bucket's tensors over, submit
        self.process_set = process_set
        self.passes_per_step = _check_passes_per_step(passes_per_step)
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = int(first_bucket_bytes)
        self.alone_bytes = alone_bytes
        self.large_bucket_bytes = large_bucket_bytes      # after backward: the cap of a bucket of large members
        self.overlap = bool(overlap)
        self.collective = collective
        self.groups = explicit_groups(self.members, groups)
        self._member_of = {id(m.key): m for m in self.members}
        self.restart()

    def restart(self):
        """Back to the plan and phase of a new reducer. An elastic job calls it on every rank when the world
        changed, so survivors and newly joined workers lay out (and learn) their buckets alike."""
        self.phase = Phase.LEARNING_ORDER if self.overlap else Phase.ORDER_KNOWN
        self.layout = (Layout.USER_GROUPS if self.groups is not None
                       else Layout.GUESSED if self.overlap else Layout.BY_SIZE)
        self.state = StepState.OPEN
        self.buckets, self._bucket_of = [], {}
        self._plan(list(reversed(self.members)), generation=0)
        self.reset_step()

    # ------------------------------------------------------------ the plan

    def _plan(self, ordered, generation):
        if self.groups is not None:
            lists = self.groups
        elif self.overlap:
            lists = plan_buckets(ordered, self.first_bucket_bytes, self.bucket_bytes, self.alone_bytes)
        else:   # reduced after backward: no reason for a small first bucket, and order does not matter
            lists = plan_buckets(ordered, self.bucket_bytes, self.bucket_bytes, self.alone_bytes, keep_order=False,
                                 large_bucket_bytes=self.large_bucket_bytes)
        self.buckets = [Bucket(i, f"{self.prefix}.g{generation}.bucket{i}", members,
                               flat=(len({m.kind for m in members}) == 1 and (len(members) > 1 or members[0].host)))
                        for i, members in enumerate(lists)]
        self._bucket_of = {id(m.key): b for b in self.buckets for m in b.members}

    def bucket_of(self, key):
        """The bucket of a member's key, or None for a key the reducer does not hold (e.g. a frozen parameter)."""
        return self._bucket_of.get(id(key))

    def unbucketed(self, keys):
        """The keys of `keys` that are in no bucket (a binding's frozen parameters), in one pass."""
        bucket_of = self._bucket_of
        return [key for key in keys if id(key) not in bucket_of]

    def name_of(self, key):
        return self._member_of[id(key)].name

    # ------------------------------------------------------------ pass counting

    def set_passes_per_step(self, passes):
        """Takes effect from the next backward pass; arrivals of the current one start over."""
        self.passes_per_step = _check_passes_per_step(passes)
        for bucket in self.buckets:
            bucket.arrivals.clear()

    def arrived(self, key):
        """One member's gradient became final in this backward pass. Returns its bucket when that is now complete
        and not yet submitted, else None."""
        bucket = self._bucket_of[id(key)]
        bucket.arrivals.append(key)
        if self.phase is Phase.LEARNING_ORDER:
            count = self._first_step_counts[id(key)] = self._first_step_counts.get(id(key), 0) + 1
            if count == self.passes_per_step:
                self.ready_order.append(self._member_of[id(key)])
        return bucket if self.is_complete(bucket) else None

    def is_complete(self, bucket):
        # every member arrives once per backward pass, so k passes make k * len(members) arrivals; a member
        # arriving more often is an error that check_passes() reports
        return (len(bucket.arrivals) == self.passes_per_step * len(bucket.members)
                and bucket.index not in self.pending)

    def check_passes(self):
        """Raise RingtrainError naming a member that arrived more than passes_per_step times this step."""
        passes = self.passes_per_step
        for bucket in self.buckets:
            if len(bucket.arrivals) <= passes:
                continue
            if passes == 1 and len(set(map(id, bucket.arrivals))) == len(bucket.arrivals):
                continue   # the common case, checked in C
            counts = collections.Counter(map(id, bucket.arrivals))
            key, count = counts.most_common(1)[0]
            if count > passes:
                raise RingtrainError(
                    f"gradient of {self._member_of[key].name!r} was computed {count} times, more than "
                    f"backward_passes_per_step={passes} times before step(); call step() or synchronize() after "
                    f"every {passes} backward passes (or raise backward_passes_per_step)")

    def has_work(self):
        """A backward pass (or a submitted bucket) since the last reset."""
        return bool(self.pending) or any(bucket.arrivals for bucket in self.buckets)

    # ------------------------------------------------------------ submission and completion

    def compress(self, tensor):
        """The communication seam, outbound: (what goes on the wire, what decompress needs)."""
        return self.hook.encode(tensor)

    def decompress(self, tensor, ctx):
        """The communication seam, inbound: the reduced wire tensor as the gradient's own."""
        return self.hook.decode(tensor, ctx)

    def submit(self, bucket, arrays, outs=None, sync=False, done=None, prescaled=False):
        """Start (sync=False) or run on this thread (sync=True) the bucket's collective on `arrays` (numpy or cupy),
        into `outs` (default: in place; a None entry: the core allocates it). done(result) runs when wait() reaches
        the bucket (at once when sync). prescaled=True: the binding already multiplied the arrays by the prescale
        factor while packing them, so the collective does not again."""
        arrays = list(arrays)
        scales = self.scaling.kwargs()
        if prescaled:
            scales.pop("prescale_factor", None)
        kwargs = dict(op=self.scaling.op, name=bucket.name, process_set=self.process_set, **scales)
        if self.collective is Collective.REDUCESCATTER:
            if len(arrays) != 1:
                raise ValueError(f"a reducescatter bucket travels as one flat array, got {len(arrays)}")
            start = collectives.reducescatter if sync else collectives.reducescatter_async
            result = start(arrays[0], **kwargs)
        elif len(arrays) == 1:
            start = collectives.allreduce if sync else collectives.allreduce_async
            result = start(arrays[0], out=arrays[0] if outs is None else outs[0], **kwargs)
        else:
            start = collectives.grouped_allreduce if sync else collectives.grouped_allreduce_async
            result = start(arrays, outs=arrays if outs is None else list(outs), **kwargs)
        if sync:
            if done is not None:
                done(result)
            self.pending.setdefault(bucket.index, []).append(Pending(None, None))
        else:
            self.track(bucket, result, done)

    def track(self, bucket, handle, done=None):
        """Wait for `handle` (anything with wait()) with the bucket: done(handle.wait()) runs then."""
        self.pending.setdefault(bucket.index, []).append(Pending(handle, done))

    def submit_remaining(self, submit_bucket, last_ready_first=False):
        """Call submit_bucket(bucket) for every bucket not submitted this step, in bucket order (the same on every
        rank, so leftovers -- unused members, a step() after fewer passes -- go out deterministically), or in the
        reverse order with last_ready_first (after backward: buckets fill in expected ready order, so the last
        holds the gradients backward wrote last, the likeliest still in the cache)."""
        for bucket in (reversed(self.buckets) if last_ready_first else self.buckets):
            if bucket.index not in self.pending:
                submit_bucket(bucket)

    def wait(self):
        """Wait for every submitted bucket, in bucket order, and run their done callbacks."""
        for index in sorted(self.pending):
            for pending in self.pending[index]:
                if pending.handle is None:
                    continue
                result = pending.handle.wait()
                if pending.done is not None:
                    pending.done(result)

    def drain(self):
        """Wait for everything in flight, ignoring errors: nothing may write into a gradient later."""
        for entries in self.pending.values():
            for pending in entries:
                if pending.handle is not None:
                    try:
                        pending.handle.wait()
                    except RingtrainError:
                        pass

    def only_failed_pending(self):
        """True when every pending collective has ended in an error (e.g. the engine failed and was shut down):
        nothing writes into the gradients any more, so the pending step can simply be dropped."""
        for entries in self.pending.values():
            for pending in entries:
                if pending.handle is None:
                    continue
                if not pending.handle.poll():
                    return False
                try:
                    pending.handle.wait()
                    return False        # a successful result is still owed to the gradients
                except RingtrainError:
                    pass
        return True

    def reset_step(self):
        for bucket in self.buckets:
            bucket.arrivals.clear()   # cleared in place: hooks may hold these very lists
        self.pending = {}              # bucket index -> [Pending]
        self.ready_order = []          # members in the order their gradient became final (LEARNING_ORDER)
        self._first_step_counts = {}   # id(key) -> arrivals so far (LEARNING_ORDER)

    def mark_synchronized(self):
        self.state = StepState.SYNCHRONIZED

    def reopen(self):
        self.state = StepState.OPEN

    def is_synchronized(self):
        """Synchronized and nothing arrived since: waiting again would do nothing."""
        return self.state is StepState.SYNCHRONIZED and not self.has_work()

    # ------------------------------------------------------------ the step's lifecycle (every binding's)

    def prepare_for_backward(self):
        """The optimizer stepped: a new step begins, gradients may arrive again."""
        self.state = StepState.OPEN

    def gradient_ready(self, key):
        """A member's gradient became final (a hook, until the order is known): with overlap its bucket is launched
        as soon as it is complete."""
        bucket = self.arrived(key)
        if bucket is not None and self.overlap:
            self.launch(bucket, sync=False)

    def trigger(self, bucket):
        """The hook of a bucket's last-ready member once the order is known: count it, launch the complete bucket
        (the other members' hooks are `bucket.arrivals.append`, no Python frame)."""
        arrivals, launch, is_complete = bucket.arrivals, self.launch, self.is_complete

        def last_gradient_of_bucket(key):
            arrivals.append(key)
            if is_complete(bucket):
                launch(bucket, sync=False)
        return last_gradient_of_bucket

    def finalize(self, launch_remaining=None, last_ready_first=False, after_wait=None):
        """Finish the step's communication: check the pass counts, launch every bucket backward did not (with
        launch_remaining(bucket), default the binding's launch, synchronously after backward), wait for all in
        bucket order (their done callbacks scale back and unpack), and after the first step learn the ready order;
        after_wait(order_just_learned) runs last. Whatever fails, the next backward starts clean. Returns False,
        doing nothing, when the step is already synchronized."""
        if self.is_synchronized():
            return False
        try:
            self.check_passes()
        except RingtrainError:
            self.drain()           # nothing already in flight may write into a gradient later
            self.reset_step()
            raise
        if launch_remaining is None:
            launch, sync = self.launch, not self.overlap

            def launch_remaining(bucket):
                launch(bucket, sync=sync)
        try:
            self.submit_remaining(launch_remaining, last_ready_first=last_ready_first)
            self.wait()
            learned = self.phase is Phase.LEARNING_ORDER
            self.learn_order()
            if after_wait is not None:
                after_wait(learned)
        except BaseException:
            # a failed collective (stall, shutdown) must not leave the binding waiting on dead handles forever
            self.reset_step()
            raise
        self.reset_step()
        self.mark_synchronized()
        return True

    def check_zero_grad(self):
        """zero_grad() drops the step's unreduced gradients and their pass count; an error while a collective
        still writes into them (collectives that all failed are simply dropped)."""
        if self.pending and self.only_failed_pending():
            self.reset_step()
        if self.pending:
            writing = ("gradient buckets are still being reduce-scattered" if self.collective is Collective.REDUCESCATTER
                       else "allreduces are still writing into the gradients")
            raise RingtrainError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 f"or optimizer.synchronize(): {writing} (buckets {sorted(self.pending)})")
        self.reset_step()

    def drop_pending(self):
        """Wait for the collectives in flight (running their done callbacks) and forget the step's arrivals: the
        next backward starts a fresh step (load_state_dict, a new pass count)."""
        try:
            if self.pending:
                self.wait()
        finally:
            self.reset_step()
            self.prepare_for_backward()

    # ------------------------------------------------------------ re-planning

    def learn_order(self):
        """After the first step with overlap: re-lay buckets in observed order (unless they are the user's groups);
        from now on only each bucket's last-ready member submits it."""
        if self.phase is not Phase.LEARNING_ORDER:
            return
        if self.layout is Layout.GUESSED:
            self._replan_in_ready_order()
        self.phase = Phase.ORDER_KNOWN
        self._ready_position = {id(m.key): i for i, m in enumerate(self.ready_order)}

    def _replan_in_ready_order(self):
        """As torch DDP: lay buckets out in the order gradients actually became final, so the first bucket really is
        ready first. Ranks may observe different orders, so rank 0's wins; it travels as an allreduce (Sum, other
        ranks contribute zeros) rather than a broadcast, which also works while ranks join."""
        self.layout = Layout.OBSERVED
        position = {id(m.key): i for i, m in enumerate(self.members)}
        mine = [position[id(m.key)] + 1 for m in self.ready_order]
        mine += [0] * (len(self.members) - len(mine))   # members unused in step 1 have no place yet
        first = self.process_set.rank() == 0
        order = np.array(mine if first else [0] * len(mine), dtype=np.int64)
        collectives.allreduce(order, op=Sum, name=self.prefix + ".bucket_order", out=order, process_set=self.process_set)
        chosen = [i for i in order.tolist() if i]
        if not chosen:
            return   # rank 0 had already joined (all zeros): keep the current layout
        placed = set(chosen)
        unseen = [m for m in reversed(self.members) if position[id(m.key)] + 1 not in placed]
        self._plan([self.members[i - 1] for i in chosen] + unseen, generation=1)

    def last_ready(self, bucket):
        """The member whose gradient became final last in the first step: with overlap, its hook submits the
        bucket. None without overlap, before the order is known, or when no member of the bucket was seen."""
        if not self.overlap or self.phase is not Phase.ORDER_KNOWN:
            return None
        seen = [m for m in bucket.members if id(m.key) in self._ready_position]
        return max(seen, key=lambda m: self._ready_position[id(m.key)]) if seen else None


def _check_passes_per_step(passes):
    if int(passes) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    return int(passes)
