"""OSU-style all-reduce latency: harmpi vs MPI_Allreduce vs gloo, same ranks.

    mpirun -np 2 python -m mpi4py -m bench.osu_allreduce -c --impl harmpi,mpi,gloo
    HARMPI_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m bench.osu_allreduce -f

See ``bench.harness`` for the method and ``bench.impls`` for what each
implementation times (mpi reduces float32 of the same bytes for bf16).
"""

from bench.harness import ALLREDUCE
from bench.osu import command

main = command(ALLREDUCE)

if __name__ == "__main__":
    main()
