"""What every collective is built on: records, words and memory ranks share.

``dtypes``    the dtype table: every fact about a storage format, in one place
``kind``      the kind word ranks compare before combining anything
``control``   the control block: one rank's per-context state as one typed record
``atomics``   atomic loads and stores, clocks, futex, pause and yield (intrinsics)
``sync``      the flag waits: spin, yield, then futex sleep, with deadlines
``copytune``  how ranks fill the shared slots (plain, streaming, flushing)
``arena``     the node's shared window: flag lines, slots and their geometry
``topology``  who is on which node, and the polled votes ranks agree by
"""
