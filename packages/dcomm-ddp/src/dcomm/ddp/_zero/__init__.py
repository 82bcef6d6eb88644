"""ZeRO overlap internals behind :mod:`dcomm.ddp.zero_overlap`, one concept per module.

``layout`` predicts DDP's settled buckets and who owns what; ``driver`` is what every hook does
per bucket; ``parameter_driver`` (whole parameters per owner) and ``sharded_driver``
(element-wise slices, ``reduce_scatter=True``) are the two kinds of update; ``checkpoint``
converts the sharded optimizer state to torch's format; ``step_mode`` says when the local
optimizer steps (per bucket, fused, or chosen by timing both); ``checks`` validates the
arguments.
"""
