"""Each rank checks the world with one MPI_Allreduce and prints one line; needs only mpi4py."""
import os

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank(), op=MPI.SUM)
expected = comm.Get_size() * (comm.Get_size() - 1) // 2
assert total == expected, f"rank {comm.Get_rank()}: allreduce of ranks gave {total}, expected {expected}"
print(f"hello from rank {comm.Get_rank()} of {comm.Get_size()} "
      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
      f"RINGTRAIN_LAUNCHER_TEST={os.environ.get('RINGTRAIN_LAUNCHER_TEST')}", flush=True)
