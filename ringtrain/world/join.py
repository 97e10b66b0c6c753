"""Join N separately started MPI processes into one world, torch.distributed style (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): MPI's dynamic processes (Open_port / Accept / Connect + Merge), with a TCP rendezvous for the port name.

    world = join_world(rank=1, size=2, master_addr="10.0.0.5", master_port=29500, timeout_s=120)

Each process must be a 1-rank MPI job started by an MPI launcher (`mpiexec -n 1 python ...`): MPICH measured here
joins those, while two bare singletons (plain `python ...`) cannot ("Local and remote groups ... must not overlap").

Order: rank 0 listens on MASTER_PORT (TCP) and opens an MPI port; every other rank connects over TCP and says who
it is. Only when all N have checked in does rank 0 start accepting: a rank that never arrives is an error naming it
after timeout_s, never an MPI call blocked forever. Then, one joiner at a time (in rank order), rank 0 sends it the
port name and the world grows by one Accept + Merge (every member takes part in each Accept). With several Connects
pending at once MPICH 5.0.2 crashed in Accept here, hence one at a time. Split finally orders the world by RANK.
"""
import os
import socket
import time

from mpi4py import MPI

from ..errors import RingtrainError
from .dynamic import accept_one, grow, merge
from .environment import plan_world


class JoinError(RingtrainError):
    """The processes of a torch.distributed-style launch could not be joined into one MPI world."""


def launched_world(comm_world, config):
    """init()'s world: MPI's own, or the processes of a torch.distributed-style launch joined into one (see
    environment.py), or the next world of an elastic job (ringtrain/world/elastic_worker.py); raises LaunchError where
    none would be the job the launcher started."""
    from . import elastic_worker as worker
    if worker.enabled():
        config.elastic = True      # a dead peer ends only this world; the driver forms the next
        config.drive_mpi_progress = True      # a joined world (below)
        return worker.elastic_world(timeout_s=max(config.stall_timeout_s, 60.0))
    kind, rendezvous = plan_world(os.environ, comm_world.Get_size())
    if kind == "mpi":
        return comm_world
    # Every message between separately started processes crosses MPI's network module, on one machine too; MPICH's
    # ofi moves data there only while the process is inside an MPI call, so the engine's waits must make one
    config.drive_mpi_progress = True
    return join_world(*rendezvous, timeout_s=max(config.stall_timeout_s, 30.0))


def join_world(rank, size, master_addr, master_port, timeout_s=120.0):
    """An intracommunicator of `size` processes ordered by `rank` (collective over all of them)."""
    if not 0 <= rank < size:
        raise JoinError(f"RANK={rank} is outside WORLD_SIZE={size}")
    if size == 1:
        return MPI.COMM_WORLD.Dup()
    if rank == 0:
        peers = _check_in(size, int(master_port), timeout_s)
        port = MPI.Open_port()
        try:
            world = MPI.COMM_SELF
            for joiner in sorted(peers):          # one Connect pending at a time (MPICH crashed on several)
                peers[joiner].sendall(f"PORT {port}\n".encode())
                world = accept_one(world, port, rank)
        finally:
            for conn in peers.values():
                conn.close()
            MPI.Close_port(port)
    else:
        port = _fetch_port_name(rank, size, master_addr, int(master_port), timeout_s)
        intercomm = MPI.COMM_SELF.Connect(port, root=0)
        world = grow(merge(intercomm, high=True), size, rank)
    ordered = world.Split(color=0, key=rank)
    world.Free()
    return ordered


def _check_in(size, master_port, timeout_s):
    """Rank 0: wait until ranks 1..size-1 have all checked in over TCP; {rank: open connection}."""
    deadline = time.monotonic() + timeout_s
    peers = {}
    with socket.create_server(("", master_port), reuse_port=False) as server:
        server.settimeout(0.5)
        try:
            while len(peers) < size - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, size)) - set(peers))
                    raise JoinError(f"rank 0: ranks {missing} of WORLD_SIZE={size} did not check in on port "
                                    f"{master_port} within {timeout_s:g} s")
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(timeout_s)
                line = conn.makefile("r").readline().split()
                claim = (int(line[0]), int(line[1])) if len(line) == 2 and all(x.isdigit() for x in line) else None
                problem = (None if claim and claim[1] == size and 0 < claim[0] < size and claim[0] not in peers else
                           f"rank 0 (WORLD_SIZE={size}, ranks checked in: {sorted(peers)}) refuses {' '.join(line)!r}")
                if problem:
                    conn.sendall(f"ERROR {problem}\n".encode())
                    conn.close()
                    raise JoinError(problem)
                peers[claim[0]] = conn
        except BaseException:
            for conn in peers.values():
                conn.close()
            raise
    return peers


def _fetch_port_name(rank, size, master_addr, master_port, timeout_s):
    """Rank > 0: connect to rank 0 (retrying while it starts), check in, read the MPI port name."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((master_addr, master_port), timeout=5)
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise JoinError(f"rank {rank}: could not reach rank 0 at {master_addr}:{master_port} within "
                                f"{timeout_s:g} s ({error})") from None
            time.sleep(0.2)
    with conn:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        conn.sendall(f"{rank} {size}\n".encode())
        try:
            reply = conn.makefile("r").readline().strip()
        except socket.timeout:
            raise JoinError(f"rank {rank}: rank 0 at {master_addr}:{master_port} did not answer within "
                            f"{timeout_s:g} s (are all WORLD_SIZE={size} ranks started?)") from None
    kind, _, text = reply.partition(" ")
    if kind != "PORT":
        raise JoinError(f"rank {rank}: rank 0 refused to join us: {text or 'connection closed'}")
    return text
