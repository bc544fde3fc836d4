"""Profiling: what a profile records, and where a step's time goes.

``recorder``   the compiled half: one collective's record and the bounded aggregates
``breakdown``  the Python half: per-collective profiles, the last arrival, traces

The call ``harmpi.profile()`` is harmpi.profile, in the API above.
"""
