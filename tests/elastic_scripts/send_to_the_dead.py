"""An elastic survivor keeps going when a worker dies with messages between them in flight: MPI must leave it alone,
not take it with the dead. The two ranks exchange 400 KB messages until rank 1 SIGKILLs itself in the middle of one;
rank 0 waits until the driver's word has reached its engine, lets MPI's progress run on the dead connection for
0.2 s and says it survived (on libfabric's default provider MPICH aborted it there, at the completion-queue error
of its exchange). Then it sends to rank 1, as a send that leaves before the driver's word would, on a thread, and
says what the send did within a second: MPICH's ucx module crashed the process inside MPI_Isend; libfabric's tcp
provider blocks in it (and holds MPI: the process can only exit, see ringtrain/world/elastic_worker.py)."""
import os
import threading
import time

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state as core_state
from ringtrain.engine.watchdog import _alive

rt.init()
comm = core_state.engine().ctrl
exchange = comm.Dup()
peer = 1 - rt.rank()
send, received = np.ones(100_000, np.float32), np.zeros(100_000, np.float32)
peer_pid = exchange.allgather(os.getpid())[peer]
start = time.monotonic()
while True:                             # exchanges in flight when rank 1 dies (rank 0's never complete)
    if not _alive(peer_pid):
        # rank 0 finished the round rank 1 died in (rank 1 had not seen it finish): a new round's send would go to
        # the dead, which on the tcp provider blocks in MPI_Isend (seen under load, 1 run in 25); its death is known
        # here before the driver's word, so no new round (a death between this look and the send stays possible)
        break
    requests = [exchange.Isend(send, dest=peer, tag=7), exchange.Irecv(received, source=peer, tag=7)]
    while not all(r.Test() for r in requests):
        if rt.rank() == 1 and time.monotonic() - start > 0.3:
            os.kill(os.getpid(), 9)
        if core_state.engine().failed is not None:
            break
    if core_state.engine().failed is not None:
        break
deadline = time.monotonic() + 60
while core_state.engine().failed is None:
    if time.monotonic() > deadline:
        raise RuntimeError("rank 1's death never reached rank 0")
    time.sleep(0.01)
end = time.monotonic() + 0.2
while time.monotonic() < end:           # MPI's progress runs in these calls: let it see the dead connection
    comm.Iprobe(source=MPI.ANY_SOURCE, tag=99)
    time.sleep(1e-3)
os.write(1, b"rank 0: SURVIVED the exchange in flight\n")
outcome = ["blocked"]         # what a send to the dead worker did, as one that leaves before the driver's word would


def send_to_the_dead():
    try:
        request = comm.Isend([np.zeros(64, np.uint8), MPI.BYTE], dest=1, tag=99)
        for _ in range(100):
            if request.Test():
                break
            time.sleep(1e-3)
        outcome[0] = "returned"
    except MPI.Exception as e:
        outcome[0] = f"raised error class {e.Get_error_class()}"


sender = threading.Thread(target=send_to_the_dead, daemon=True)
sender.start()
sender.join(1.0)
os.write(1, f"rank 0: SEND TO THE DEAD {outcome[0]}\n".encode())
os._exit(0)
