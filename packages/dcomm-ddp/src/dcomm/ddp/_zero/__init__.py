"""ZeRO overlap internals behind :mod:`dcomm.ddp.zero_overlap`, one concept per module.

``layout`` predicts DDP's settled buckets and who owns what; ``driver`` is what every hook does
per bucket; ``parameter_driver`` (whole parameters per owner) and ``sharded_driver``
(element-wise slices, ``reduce_scatter=True``) are the two kinds of update; ``send_groups`` packs
the pieces that return in one all-gather; ``forward_waits`` lets each module's forward wait for
its own parameters (``gather_during_forward=True``); ``fused_step`` runs the local Adam step in
torch's fused kernel; ``checkpoint`` converts the sharded optimizer state to torch's format;
``checks`` validates the arguments.

Glossary:

- *driver*: the object behind one overlap hook (``driver(state, bucket)`` is the hook); it holds
  the per-(ddp, zero) state: plans, side stream, collectives in flight.
- *plan*: how one of DDP's buckets is communicated and updated, made once per bucket layout.
- *owner*: the rank that steps a parameter (``reduce_scatter=False``); *piece*: the parameters one
  owner has in one bucket; *shard*: one planned bucket packed flat and cut into ``world`` equal
  *slices* (``reduce_scatter=True``).
- *settled*: DDP has rebuilt its buckets after the first iteration; plans made since are final.
- *C++ hook*: the hook on DDP's reducer that communicates every bucket once DDP settled and calls
  the driver at the last bucket only (``hook_with_zero_step``); ``native_switch`` turns it on.
"""
