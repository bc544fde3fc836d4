"""OSU-style allgather latency: harmpi vs MPI_Allgather vs gloo, same ranks.

Size is the number of bytes each rank contributes; every rank receives
n_ranks x Size bytes (concatenation in rank order).

    mpirun -np 2 python -m mpi4py -m bench.osu_allgather -c --impl harmpi,mpi,gloo
"""

from bench.harness import ALLGATHER
from bench.osu import command

main = command(ALLGATHER)

if __name__ == "__main__":
    main()
