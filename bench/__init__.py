"""Benchmarks of harmpi against MPI and Gloo.

Modules:

``harness``
    The pure parts shared by every microbenchmark: message sizes, iteration
    defaults, collective descriptors (init data, expected result, bus-bandwidth
    factor), the barrier-fenced timing loop, statistics, table and JSON rows.
``impls``
    One adapter per implementation under test: ``harmpi[:algorithm]``,
    ``mpi`` (mpi4py) and ``gloo`` (torch.distributed), shared by the OSU
    harness and the decode benchmark; ``deepspeed_op`` holds DeepSpeed's.
``osu``
    The OSU-style command line shared by ``osu_allreduce`` and
    ``osu_allgather``.
``decode``
    A Qwen2.5-shaped tensor-parallel decode loop, one run per backend; its
    model is ``model``, its numbers and table ``decode_results``, its
    threads per rank ``threads``.
``moe_decode``
    Expert against tensor parallelism on a Qwen3-MoE-shaped model
    (``moe_model``, built on ``model``'s shared pieces).
``demo``
    ``make demo``: the mpirun jobs behind the README's results.

Run them under MPI, for example::

    mpirun -np 2 python -m mpi4py -m bench.osu_allreduce -c --impl harmpi,mpi,gloo
    mpirun -np 4 python -m mpi4py -m bench.decode --comm harmpi,gloo
    python -m bench.demo
"""
