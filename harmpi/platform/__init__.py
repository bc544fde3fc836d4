"""The bottom layer: harmpi's shims over the OS, MPI and the interpreter.

Nothing here knows about collectives; each module uses only the standard
library, mpi4py and harmpi.config / harmpi.errors.

``mpiload``      importing mpi4py, with one error naming the extras when no MPI is found
``mpiprogress``  letting MPI make progress while harmpi waits in compiled code
``schedslice``   a short scheduler slice for the threads that run collectives
``llvmcompat``   llvmlite's library handle made harmless to vLLM's module scan
``worldenv``     torchrun's rank variables under a bare MPI launcher
``machine``      which physical machine this is (the kernel's boot id)
``failfast``     a rank that fails ends the whole job (``harmpi.failfast.install()``)
"""
