"""Benchmarks of harmpi against MPI and Gloo.

Modules, the harness first:

``harness``
    The measurement method of every microbenchmark, pure: message sizes,
    iteration defaults, collective descriptors (``ALLREDUCE``,
    ``ALLGATHER``, ``ALLTOALL``: init data, expected result, bus-bandwidth
    factor), the barrier-fenced timing loop, statistics.
``report``
    Result rows, the OSU-layout tables, the ``--json`` document, the plots.
``job``
    The job around a benchmark: topology and header lines, the rank-0-only
    ``--help``, one agreed exit code, abort on an error.
``impls``
    The adapters under test by name (``impl_base`` is their contract;
    ``impl_harmpi``, ``impl_mpi``, ``impl_torch``, ``deepspeed_op`` the
    adapters): all-reduce, all-gather and all-to-all on prepared buffers
    for the OSU harness and on torch tensors for the decode benchmarks.
``osu``
    The OSU-style command of a collective (``osu_allreduce``,
    ``osu_allgather``); ``osu_alltoall`` times the adapters' all-to-all in
    rounds, with uneven counts on request.
``decode``, ``moe_decode``
    Tensor-parallel decode of a Qwen2.5-shaped model (``model``) and expert
    against tensor parallelism on a Qwen3-MoE-shaped one (``moe_model``);
    what they share is ``decode_common``, their numbers and tables
    ``decode_results``, threads per rank ``threads``.
``demo``
    ``make demo``: the mpirun jobs behind the README's results, one closing
    table and a plot.

Run them under MPI, for example::

    mpirun -np 2 python -m mpi4py -m bench.osu_allreduce -c --impl harmpi,mpi,gloo
    mpirun -np 4 python -m mpi4py -m bench.decode --comm harmpi,gloo
    python -m bench.demo
"""
