"""Rank argv[1] exits with code argv[2]; the other ranks wait in a barrier that can never complete.

argv[3] says how the rank goes: 'crash' ends the process at once (no MPI_Finalize), as a crashed rank would, and
hydra tears the job down itself; 'exit' is a clean sys.exit() whose MPI_Finalize lets hydra think all is well, so it
would wait for the blocked ranks forever -- only the launcher can end that job."""
import os
import sys

from mpi4py import MPI

failing_rank, code, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
comm = MPI.COMM_WORLD
if comm.Get_rank() == failing_rank:
    print(f"rank {failing_rank} exiting with code {code} ({how})", flush=True)
    if how == "crash":
        os._exit(code)
    sys.exit(code)
comm.Barrier()
