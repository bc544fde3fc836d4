"""The machinery between the API and the algorithms: contexts and their life.

``compilepool``  the kernels compiled by several processes at once
``compilenote``  kernels compile once per host and say so (run at ``import harmpi``)
``owner``        which thread may call a communicator's collectives
``torchbuf``     torch tensors as raw memory (the only module that imports torch)
``waits``        how a context's waits spin, yield and sleep
``signals``      Ctrl-C held over a set-up, and the wakeup pipe drained after a wait
``entries``      what a context runs for a collective, chosen when it is made
``switches``     auto's size switches: the user's, else the cost model's (rank 0's)
``failures``     a failed step's status turned into the exception every rank raises
``context``      one communicator's context: topology, arena, transports, entries
``native``       the torch extension harmpi._C (``harmpi.native``: load, name_group, status)
``registry``     contexts by communicator; the free, finalize, fork and exit hooks
"""
