"""Post-local SGD for DDP: average gradients globally for a warm-up, then only within a node.

For the first ``start_localSGD_iter`` iterations :func:`post_localSGD_hook` averages gradients
over ``process_group`` exactly like :func:`~dcomm.ddp.allreduce_hook`. From then on it averages
them only within ``subgroup`` (one group per node by default), or not at all when
``post_local_gradient_allreduce=False``; a model averager that runs after ``optimizer.step()``
(with ``warmup_steps == start_localSGD_iter``) keeps the replicas from drifting apart.

Unlike torch's version, :class:`PostLocalSGDState` can be checkpointed (``state_dict()`` /
``load_state_dict()``), keeps counting iterations after the switch, builds its intra-node
subgroups from nodes that every rank agrees on (host and ``LOCAL_WORLD_SIZE``; it also works on
CPU), and rejects bad arguments with an error that says what to pass.

Example::

    >>> from dcomm.ddp import PostLocalSGDState, post_localSGD_hook
    >>> state = PostLocalSGDState(None, None, start_localSGD_iter=100)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, post_localSGD_hook)  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import (
    allreduce_future,
    completed_future,
    get_logger,
    intra_node_subgroups,
    plan_average,
    rank_device,
    resolve_group,
)
from dcomm.core.validation import boolean, check_state_dict, non_negative_int, process_group_or_none

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = get_logger(__name__)  # rank 0 only

_STATE_KEYS = ("iter", "start_localSGD_iter", "post_local_gradient_allreduce")


def _check_iter(name: str, value: object) -> int:
    return non_negative_int(name, value, "pass what PostLocalSGDState.state_dict() returned")


class PostLocalSGDState:
    """What :func:`post_localSGD_hook` needs: the groups, the switch iteration and the counter.

    Args:
        process_group: the group gradients are averaged over before the switch (WORLD when None).
        subgroup: the group they are averaged over after it. When None, one group per node is
            built (:func:`dcomm.core.intra_node_subgroups`: nodes agreed by every rank from its
            host and ``LOCAL_WORLD_SIZE``): here if the default process group already exists,
            otherwise at the first local step. Every rank must construct the state (this is
            collective); node sizes that disagree between ranks or with the hosts are a
            ``ValueError`` on every rank, before training starts.
        start_localSGD_iter: how many iterations average globally before the switch (>= 0).
        post_local_gradient_allreduce: average within ``subgroup`` after the switch (True), or
            leave each rank's gradient untouched (False).

    ``iter`` counts the iterations seen so far (once per backward, on its last bucket), also after
    the switch. ``state_dict()`` / ``load_state_dict()`` save and restore the counter and the
    schedule; a restored job continues exactly where it stopped (the schedule itself stays the
    constructed one, and a checkpoint saved with another warns).

    Example::

        >>> state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, post_localSGD_hook)  # doctest: +SKIP
        >>> torch.save({"hook": state.state_dict(), ...}, "ckpt.pt")  # doctest: +SKIP
    """

    __slots__ = (
        "iter",
        "post_local_gradient_allreduce",
        "process_group",
        "start_localSGD_iter",
        "subgroup",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        subgroup: dist.ProcessGroup | None,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        self.process_group = process_group_or_none(
            "process_group", process_group, "pass the group to average over before the switch, or None"
        )
        self.subgroup = process_group_or_none(
            "subgroup",
            subgroup,
            "pass the group holding this rank to average within after the switch, or None for one group per node",
        )
        self.start_localSGD_iter = non_negative_int(
            "start_localSGD_iter",
            start_localSGD_iter,
            "pass the number of globally averaged iterations before local SGD starts, e.g. 100",
        )
        self.post_local_gradient_allreduce = boolean(
            "post_local_gradient_allreduce",
            post_local_gradient_allreduce,
            "pass True to average within the subgroup after the switch, False to skip it",
        )
        self.iter = 0
        if self.subgroup is None and self.post_local_gradient_allreduce and dist.is_initialized():
            _local_group(self, rank_device(resolve_group(None)))
        logger.info("post-local SGD: local SGD starts after %d iterations", self.start_localSGD_iter)

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one iteration when ``bucket`` is the last of a backward pass (as torch's state does).

        :func:`post_localSGD_hook` calls it for every bucket; so does torch's hook, which makes this
        state usable with either.

        Example::

            >>> state.maybe_increase_iter(bucket)  # doctest: +SKIP
        """
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_localSGD_iter:
                logger.info("post-local SGD: local SGD from iteration %d on", self.iter)

    def state_dict(self) -> dict[str, Any]:
        """The counter and the schedule, as plain Python values (no process groups).

        Example::

            >>> checkpoint["post_local_sgd"] = state.state_dict()  # doctest: +SKIP
            >>> state.state_dict()  # doctest: +SKIP
            {'iter': 12, 'start_localSGD_iter': 10, 'post_local_gradient_allreduce': True}
        """
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the iteration counter that :meth:`state_dict` saved.

        Everything is checked before ``iter`` changes. The schedule (``start_localSGD_iter``,
        ``post_local_gradient_allreduce``) and the groups stay those this state was constructed
        with; a saved schedule that differs warns, as the averagers do for their settings, so a
        hook/averager schedule mismatch never goes unnoticed.

        Example::

            >>> state = PostLocalSGDState(None, None, start_localSGD_iter=10)  # doctest: +SKIP
            >>> state.load_state_dict(checkpoint["post_local_sgd"])  # doctest: +SKIP
        """
        settings = {key: getattr(self, key) for key in _STATE_KEYS if key != "iter"}
        checked = check_state_dict(type(self).__name__, state_dict, {"iter": _check_iter}, settings)
        self.iter = checked["iter"]

    def __repr__(self) -> str:
        return (
            f"PostLocalSGDState(iter={self.iter}, start_localSGD_iter={self.start_localSGD_iter}, "
            f"post_local_gradient_allreduce={self.post_local_gradient_allreduce})"
        )


# What torch's PostLocalSGDState has: a state with these works here too (a partial migration).
_STATE_ATTRIBUTES = (
    "process_group",
    "subgroup",
    "start_localSGD_iter",
    "post_local_gradient_allreduce",
    "iter",
    "maybe_increase_iter",
)


def _check_foreign_state(state: object) -> None:
    missing = [name for name in _STATE_ATTRIBUTES if not hasattr(state, name)]
    if missing:
        kind = type(state)
        raise TypeError(
            f"state: post_localSGD_hook expects a dcomm.ddp.PostLocalSGDState or a "
            f"torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook.PostLocalSGDState, got "
            f"{kind.__module__}.{kind.__qualname__} (no {', '.join(missing)}); register it as "
            "ddp_model.register_comm_hook(PostLocalSGDState(...), post_localSGD_hook)"
        )


def _local_group(state: Any, device: torch.device | None) -> dist.ProcessGroup:
    """``state.subgroup``, building the intra-node subgroups on first use (agreed through ``device``)."""
    if state.subgroup is None:
        state.subgroup, _ = intra_node_subgroups(device=device)
    assert state.subgroup is not None
    return state.subgroup


def post_localSGD_hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket globally before ``state.start_localSGD_iter``, locally after it.

    Before the switch: divide by the size of ``state.process_group`` and sum over it, bit-identical
    to :func:`~dcomm.ddp.allreduce_hook` and torch's hook. After it: the same within
    ``state.subgroup``, or nothing when ``state.post_local_gradient_allreduce`` is False. The
    iteration counter advances once per backward, on its last bucket. torch's
    ``PostLocalSGDState`` works here too, and this module's state works with torch's hook.

    Example::

        >>> state = PostLocalSGDState(None, None, start_localSGD_iter=10)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, post_localSGD_hook)  # doctest: +SKIP
        >>> averager = PeriodicModelAverager(period=4, warmup_steps=10)  # doctest: +SKIP
        >>> # each step: loss.backward(); opt.step(); averager.average_parameters(model.parameters())
    """
    if not isinstance(state, PostLocalSGDState):
        _check_foreign_state(state)
    buffer = bucket.buffer()
    local = state.iter >= state.start_localSGD_iter
    group: dist.ProcessGroup | None = None
    if not local:
        group = resolve_group(state.process_group)
    elif state.post_local_gradient_allreduce:
        group = _local_group(state, buffer.device)
    state.maybe_increase_iter(bucket)
    if group is None or group.size() == 1:
        return completed_future(buffer)
    # torch's arithmetic, bit for bit: divide by the group size, then SUM.
    plan = plan_average(
        group, buffer.dtype, buffer.device, arithmetic="predivide", nccl_average=False, nccl_premul=False
    )
    return allreduce_future(buffer, group, predivide=plan.pre, postdivide=plan.post, op=plan.op)
