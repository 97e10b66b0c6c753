"""After a stall (in the world or inside a process set) the next collectives work, and shutdown() then init()
gives a working engine too: the error does not poison later calls. Runs with a 1 s stall timeout, then restores the session's world."""
import os
import tempfile
import time

import numpy as np
import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd

STALL = dict(stall_warning_s=0.5, stall_timeout_s=1.0)   # four stalls run out one after the other


def usable(tag):
    got = rt.allreduce(np.full(3, rt.rank() + 1.0), op=rt.Sum, name=f"recovery.usable.{tag}")
    np.testing.assert_array_equal(got, np.full(3, rt.size() * (rt.size() + 1) / 2))


@pytest.fixture()
def restore_world():
    yield
    rt.shutdown()
    rt.init(process_sets="dynamic")        # Horovod's spelling; sets can always be added later here


@pytest.mark.mpi(min_size=2)
def test_shutdown_and_init_recover_from_stalls(restore_world):
    # built and warmed up first, under the session's generous timeouts (first torch calls are slow on a busy machine)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()
    rt.shutdown()
    pair = rt.ProcessSet([0, 1])
    rt.init(process_sets=[pair], **STALL)
    assert pair.process_set_id is not None and pair.included() == (rt.rank() in (0, 1))

    # 1. a stall inside a process set: its two members reduce different names, so neither ever completes
    markers = rt.broadcast_object(tempfile.mkdtemp(prefix="ringtrain-recovery-"), root_rank=0)
    if pair.included():
        with pytest.raises(rt.StallError, match=r"recovery\.(lonely|other)"):     # on both members
            rt.allreduce(np.ones(2), name="recovery.lonely" if rt.rank() == 0 else "recovery.other",
                         process_set=pair)
        # the stall ended those two collectives, nothing else: the set's next collective works
        np.testing.assert_array_equal(rt.allreduce(np.ones(2), op=rt.Sum, name="recovery.later", process_set=pair),
                                      [2.0, 2.0])
        open(os.path.join(markers, str(rt.rank())), "w").close()
    else:   # outside the set: make no world call until the members are done, or the world would stall too
        deadline = time.monotonic() + 60
        while len(os.listdir(markers)) < 2:
            assert time.monotonic() < deadline, "the set's members never finished their stall"
            time.sleep(0.01)
    usable("after_set_stall")                    # the world's engine is untouched

    # 2. a stall in the world, through the torch binding and a DistributedOptimizer
    if rt.rank() == 0:
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(hvd.HorovodInternalError):
            opt.step()                           # rank 0 waits for its gradients' allreduce ...
    else:
        with pytest.raises(rt.StallError):       # ... while the others reduce something else: a stall
            rt.allreduce(np.ones(1), name="recovery.other_world")
    opt.zero_grad()                              # failed allreduces leave no pending gradient state behind

    rt.shutdown()
    assert pair.process_set_id is None           # sets end with the job that registered them
    rt.init(process_sets=[rt.ProcessSet([0, 1])])
    usable("after_reinit")
    pair = rt.core.process_sets.process_sets()[1]
    if pair.included():
        np.testing.assert_array_equal(rt.allreduce(np.ones(2), op=rt.Sum, process_set=pair), [2.0, 2.0])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()                                   # the same optimizer works on the new engine
