"""harmpi's command lines (``python -m harmpi.run|precompile|report|tune`` run these).

``cliout``      the one output of the commands (the logger ``harmpi.cli``)
``run``         ``python -m harmpi.run``: a program with failfast and torchrun's variables
``precompile``  ``python -m harmpi.precompile``: compile every kernel, say how long
``report``      ``python -m harmpi.report``: a PNG timeline from a profile trace
``tune``        ``python -m harmpi.tune``: measure the host for auto's cost model, keep it
"""
