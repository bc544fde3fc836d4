"""The machinery between the API and the algorithms: contexts and their life.

``compilepool``  the kernels compiled by several processes at once
``compilenote``  kernels compile once per host and say so (run at ``import harmpi``)
``owner``        which thread may call a communicator's collectives
``torchbuf``     torch tensors as raw memory (the only module that imports torch)
``context``      one communicator's set-up: its algorithm, transports and entries
``registry``     contexts by communicator; the free, finalize, fork and exit hooks
"""
