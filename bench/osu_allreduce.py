"""OSU-style all-reduce latency: harmpi vs MPI_Allreduce vs gloo vs DeepSpeed, same ranks.

    mpirun -np 2 python -m mpi4py -m bench.osu_allreduce -c --impl harmpi,mpi,gloo
    mpirun -np 2 --bind-to core python -m mpi4py -m bench.osu_allreduce --impl harmpi,deepspeed,mpi
    HARMPI_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m bench.osu_allreduce -f

Options follow OSU: ``-m MIN:MAX`` sizes, ``-i``/``-x`` iterations and
warm-up, ``-f`` Min/Max/Iterations (and BusBW), ``-c`` check with a
Pass/Fail column and a non-zero exit on any failure.  Then ``--impl``,
``--dtype``, ``--stat mean|median``, ``--json``, ``--plot``.

mpi4py asks MPI for MPI_THREAD_MULTIPLE; some MPIs pick slower paths then
(MPICH skips its shared-memory all-reduce).  To time MPI at another thread
level: ``python -m mpi4py -rc thread_level=single -m bench.osu_allreduce``.
The header states the level in use.

See ``bench.harness`` for the method and ``bench.impls`` for what each
implementation times (mpi reduces float32 of the same bytes for bf16).
"""

from bench.harness import ALLREDUCE
from bench.osu import command

main = command(ALLREDUCE)

if __name__ == "__main__":
    main()
