"""Private pieces of :class:`dcomm.averaging.DiLoCoOptimizer`: fragments and the pseudo-gradient exchange.

Example::

    >>> from dcomm.averaging._diloco.fragments import sync_offsets
    >>> sync_offsets(sync_every=100, fragments=4)
    [25, 50, 75, 0]
"""
