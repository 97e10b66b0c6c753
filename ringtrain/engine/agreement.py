"""How the ranks agree on what to run next, and which agreement a communicator gets (make_agreement).

Every agreement has one small interface, which the engine (engine.py) drives:

  add(request) / add_control("join" | "shutdown")   what this rank has newly submitted
  poll() -> [Action]                                 the next agreed actions; the same list, in the same order,
                                                     on every rank
  owes() -> bool                                     something is pending that a peer may answer soon
  express(name, meta, array, ...)                    a synchronous cached host allreduce with nothing else pending:
                                                     its Collective to run now, or None (take the general path)

The agreements, and which one a communicator (the world, or a process set) gets:
  - one rank: SoloAgreement (solo.py) -- the Coordinator's protocol plus an express path that needs no cycle;
  - ranks on one node, or up to MESSAGE_CYCLE_MAX_RANKS ranks across nodes: CycleAgreement (cycle_agreement.py) --
    the ranks agree in cycles of slots exchanged through a shared window (one node) or messages (across nodes),
    with no rank 0 in the steady state, and small allreduces travel in the slots (eager);
  - more ranks across nodes: CoordinatorAgreement (coordinator_agreement.py) -- every decision through rank 0's
    Coordinator (negotiation.py; Horovod's original protocol).
Its messages travel on the engine's control channel (control.py). The slots' eager sizes are set here
(window_eager_bytes, EAGER_BYTES).
"""
from .coordinator_agreement import CoordinatorAgreement
from .cycle_agreement import CycleAgreement
from .cycle_exchange import MESSAGE_CYCLE_MAX_RANKS, MessageExchange, WindowExchange
from .solo import SoloAgreement

EAGER_BYTES = 64 << 10      # across nodes: a slot, eager data included, travels to every peer as a message
WINDOW_EAGER_BYTES = 2 << 20    # on one node the slots are shared memory: eager up to this / N (64 KB .. 1 MB)


def window_eager_bytes(size):
    """How large an allreduce may travel in the cycle's shared-memory slots on one node of `size` ranks. Eager costs
    one synchronisation instead of three (the cycle, then the transport's two) but every rank reads all N copies, so
    the limit falls with N. Measured on 2 cores, private float32, against the express cycle followed by the
    transport (same-run A/B): 2 ranks eager wins at 512 KB and 1 MB (154-173 vs 258-306 us; 239-251 vs 288-395)
    and loses at 2 MB (390-500 vs 321-446); 4 ranks it wins at 512 KB and ties at 1 MB. The 1/N rule beyond 4
    ranks is that traffic argument, not a measurement."""
    limit = max(EAGER_BYTES, WINDOW_EAGER_BYTES // max(size, 1))
    return limit // 4096 * 4096        # whole pages: slots stay aligned for any dtype and for the cache


def make_agreement(topology, control, config, watchdog, copy_in, shared=None):
    """One rank: the SoloAgreement. One node: cycles through a shared window. Several nodes: cycles through
    messages, up to MESSAGE_CYCLE_MAX_RANKS ranks (each cycle costs N - 1 messages per rank); beyond that the
    coordinator. shared(array): does the host transport reduce this array where it lies (see
    cycle_agreement.CycleAgreement._eager_fits)? copy_in(slot, array): the executor's copy of an eager allreduce's
    data into this rank's slot."""
    # rank 0 assigns the ids, and every rank's slots must hold its bitmaps: rank 0's capacity is the job's
    capacity = max(0, int(control.ctrl.bcast(config.cache_capacity, root=0)))
    if topology.size == 1:
        return SoloAgreement(control, config, watchdog, capacity)
    words = max(1, -(-capacity // 64))
    if topology.single_node:
        exchange = WindowExchange(topology.local, config, watchdog, words, window_eager_bytes(topology.size),
                                  copy_in, native=config.native)
    elif topology.size <= MESSAGE_CYCLE_MAX_RANKS:
        exchange = MessageExchange(control.ctrl, config, watchdog, words, EAGER_BYTES, copy_in)
    else:
        return CoordinatorAgreement(control, config, watchdog, capacity)
    return CycleAgreement(control, exchange, config, watchdog, capacity, shared)
