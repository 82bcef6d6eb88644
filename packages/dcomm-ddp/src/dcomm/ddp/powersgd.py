"""PowerSGD gradient compression for DDP, a drop-in for torch's ``powerSGD_hook`` module.

Each gradient matrix ``M`` (n x m) is sent as two thin factors: ``P = M Q`` (n x r) is summed
over the ranks and orthogonalised, then ``Q = M^T P`` (m x r) is averaged, and ``P Q^T`` replaces
the gradient. Error feedback adds what the approximation missed to the next step's gradient;
warm start reuses last step's ``Q``. :func:`batched_powerSGD_hook` compresses the whole bucket as
one square matrix instead.

The names, arguments and results are torch's (same seeds, same P/Q, same arithmetic). Unlike
torch's:

- :class:`PowerSGDState` has ``state_dict()`` / ``load_state_dict()`` holding the error-feedback
  memory, the P/Q matrices, the counters and the random stream: a restored job continues
  bit-identically, into the state already registered with DDP;
- ``start_powerSGD_iter`` may be 1 (or 0): memory made before DDP rebuilt its buckets is detected
  by the bucket's layout and started afresh instead of being applied to the wrong gradients;
- a step that overflowed (an inf or NaN gradient on any rank, as fp16 with a ``GradScaler``
  gives now and then) still averages to NaN, so the scaler skips it, but leaves the memories
  finite: the error restarts from zero and a warm-started ``Q`` keeps its value (torch's turn NaN,
  and so does every later step);
- no ``torch.cuda.synchronize``: temporaries are tied to the streams that use them;
- no numpy; runs on gloo and NCCL.

Example::

    >>> from dcomm.ddp import PowerSGDState, powerSGD_hook
    >>> state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, powerSGD_hook)  # doctest: +SKIP
    >>> torch.save({"powersgd": state.state_dict()}, "ckpt.pt")  # doctest: +SKIP
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not with strings.

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dcomm.core import allreduce_future, keep_until_stream_done, resolve_group
from dcomm.core.validation import boolean, non_negative_int, non_negative_number, positive_int
from dcomm.ddp._hook_state import ResumableHookState
from dcomm.ddp._ordered_chain import OrderedChain, drains_here
from dcomm.ddp._seed_stream import SeedStream

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)

# Progress saved with the memory: counters restored from a checkpoint.
_COUNTERS = (
    "iter",
    "start_powerSGD_iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)


class PowerSGDState(ResumableHookState):
    """Settings and memory of :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`.

    Args:
        process_group: the group gradients are averaged over (WORLD when None).
        matrix_approximation_rank: the rank r of the approximation (1 sends the least; 2-4 are
            usual for accuracy).
        start_powerSGD_iter: iterations of plain allreduce before compression starts (>= 0).
        min_compression_rate: a matrix is compressed only when its size is at least this many
            times the factors' size; smaller ones are allreduced uncompressed.
        use_error_feedback: add the previous step's compression error to the gradient.
        warm_start: reuse last step's Q instead of a new random one.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt (e.g. 1e-8 guards
            against all-zero columns).
        random_seed: seed of the random Q initialisations (the same numbers as torch's).
        compression_stats_logging_frequency: log compression stats every this many iterations.
        batch_tensors_with_same_shape: compress same-shaped matrices of a bucket in one batched
            multiplication.

    ``iter`` counts iterations (once per backward, on the last bucket). ``state_dict()`` /
    ``load_state_dict()`` save and restore everything a resumed job needs.

    Example::

        >>> state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)  # doctest: +SKIP
    """

    __slots__ = (
        "_layouts",
        "batch_tensors_with_same_shape",
        "compression_stats_logging_frequency",
        "iter",
        "matrix_approximation_rank",
        "min_compression_rate",
        "next_stats_report",
        "orthogonalization_epsilon",
        "p_memory_dict",
        "q_memory_dict",
        "rng",
        "start_powerSGD_iter",
        "total_numel_after_compression",
        "total_numel_before_compression",
        "use_error_feedback",
        "warm_start",
    )

    # Settings saved with the memory: a state restores only into one built with the same ones.
    _SETTINGS = (
        "matrix_approximation_rank",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "orthogonalization_epsilon",
        "batch_tensors_with_same_shape",
    )
    _MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        super().__init__(process_group)
        self.matrix_approximation_rank = positive_int(
            "matrix_approximation_rank", matrix_approximation_rank, "pass the rank of the approximation, e.g. 4"
        )
        self.start_powerSGD_iter = non_negative_int(
            "start_powerSGD_iter", start_powerSGD_iter, "pass the number of uncompressed iterations, e.g. 10"
        )
        self.min_compression_rate = non_negative_number(
            "min_compression_rate", min_compression_rate, "pass 0 to compress every tensor, e.g. 2"
        )
        self.use_error_feedback = boolean("use_error_feedback", use_error_feedback, "pass True or False")
        self.warm_start = boolean("warm_start", warm_start, "pass True or False")
        self.orthogonalization_epsilon = non_negative_number(
            "orthogonalization_epsilon", orthogonalization_epsilon, "pass 0, or e.g. 1e-8 against all-zero columns"
        )
        self.batch_tensors_with_same_shape = boolean(
            "batch_tensors_with_same_shape", batch_tensors_with_same_shape, "pass True or False"
        )
        self.rng = SeedStream(random_seed)
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        # Each bucket's layout when its memory was made, to spot DDP's bucket rebuild.
        self._layouts: dict[int, tuple] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        logger.info(
            "PowerSGD: rank %d, compression from iteration %d, error feedback %s, warm start %s",
            self.matrix_approximation_rank,
            self.start_powerSGD_iter,
            self.use_error_feedback,
            self.warm_start,
        )

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when ``bucket`` is the last of the backward pass."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD: compressing from iteration %d on", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel before, numel after)`` over all compressed iterations so far.

        Example::

            >>> rate, before, after = state.compression_stats()  # doctest: +SKIP
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def _progress(self) -> dict[str, Any]:
        counters = {key: getattr(self, key) for key in _COUNTERS}
        return {**counters, "rng": self.rng.state(), "layouts": dict(self._layouts)}

    def _progress_checks(self, fix: str) -> dict[str, Callable[[str, Any], Any]]:
        def count(name: str, value: Any) -> int:
            return non_negative_int(name, value, fix)

        def stream(name: str, value: Any) -> SeedStream:
            rng = SeedStream(0)
            try:
                rng.set_state(list(value))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{name}: not a saved random stream ({err}); {fix}") from err
            return rng

        def layouts(name: str, value: Any) -> dict[int, tuple]:
            if not isinstance(value, Mapping):
                got = type(value).__name__
                raise TypeError(f"{name}: expected a mapping of bucket index to layout, got {got}; {fix}")
            return dict(value)

        return {**dict.fromkeys(_COUNTERS, count), "rng": stream, "layouts": layouts}

    def _restore(self, progress: dict[str, Any]) -> None:
        for key in _COUNTERS:
            setattr(self, key, progress[key])
        self.rng = progress["rng"]
        self._layouts = progress["layouts"]

    def __getstate__(self) -> dict[str, Any]:
        # Like torch's: picklable without the process group, which is WORLD again on unpickling.
        slots = (*ResumableHookState.__slots__, *PowerSGDState.__slots__)
        return {slot: getattr(self, slot) for slot in slots if slot not in ("process_group", "_chain")}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.process_group = None
        self._chain = OrderedChain()
        for slot, value in state.items():
            setattr(self, slot, value)

    def __repr__(self) -> str:
        return (
            f"PowerSGDState(matrix_approximation_rank={self.matrix_approximation_rank}, iter={self.iter}, "
            f"start_powerSGD_iter={self.start_powerSGD_iter})"
        )

    # -- memory of one bucket ------------------------------------------------------------------

    def _check_layout(self, index: int, layout: tuple) -> None:
        """Forget a bucket's memory when its layout changed (DDP rebuilt its buckets)."""
        known = self._layouts.get(index)
        if known is not None and known != layout:
            logger.info("PowerSGD: bucket %d changed its layout (DDP rebuilt its buckets); its memory restarts", index)
            for key in self._MEMORY:
                getattr(self, key).pop(index, None)
        self._layouts[index] = layout

    def _memory(self, key: str, index: int, like: torch.Tensor) -> torch.Tensor | None:
        """A bucket's saved tensor on ``like``'s device and dtype (moved once, after a restore)."""
        memory = getattr(self, key)
        tensor = memory.get(index)
        if tensor is not None and (tensor.device != like.device or tensor.dtype != like.dtype):
            tensor = memory[index] = tensor.to(device=like.device, dtype=like.dtype)
        return tensor

    def _add_error(self, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Add the bucket's saved error to ``tensor``; return the error memory, now holding the sum.

        The memory is reused rather than copied: :func:`_finish` subtracts the compressed result
        from it in place, so no step allocates a bucket-sized tensor (None without feedback).
        """
        if not self.use_error_feedback:
            return None
        error = self._memory("error_dict", index, tensor)
        if error is None:
            error = self.error_dict[index] = tensor.detach().clone()
        else:
            tensor.add_(error)
            error.copy_(tensor)
        return error

    def _random_seed_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.rng.randint(1_000_000_000))


def _check_state(state: object, hook: str) -> PowerSGDState:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"state: {hook} expects a PowerSGDState, got {type(state).__name__}; register it as "
            f"ddp_model.register_comm_hook(PowerSGDState(process_group), {hook})"
        )
    return state


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Orthonormalise the columns of each matrix of a ``[batch, n, r]`` tensor in place.

    Gram-Schmidt for r <= 2 or half precision, Householder QR otherwise (torch's choice).
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col.div_(norm if epsilon == 0 else norm + epsilon)
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest.sub_(torch.sum(col * rest, dim=1, keepdim=True) * col)
        return
    r_factor = torch.empty(matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)
    torch.linalg.qr(matrices, out=(matrices, r_factor))


def _report_stats(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("PowerSGD: iteration %d, %d -> %d elements, rate %.2f", state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _plain_average(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """An averaging allreduce of the bucket (torch's arithmetic), after the previous buckets' collectives.

    Through the state's chain: on gloo it must follow the collectives that earlier buckets launch
    from their callbacks. The closure names the group through the state, never holds it (see
    :func:`_compress_matrices`).
    """
    resolved = resolve_group(state.process_group)  # for this call only
    buffer, world = bucket.buffer(), float(resolved.size())
    state.maybe_increase_iter(bucket)
    return state._chain.run(
        lambda: allreduce_future(buffer, resolve_group(state.process_group), predivide=world),
        lambda fut: fut.value(),
        drain=drains_here(bucket, resolved),
    )


def _allreduce_and_wait(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``tensor`` in place over ``group`` and wait for it (in a future's callback).

    On NCCL the wait only orders the current stream after the sum; on gloo it blocks this
    callback's thread, which :class:`OrderedChain` keeps to one at a time.
    """
    dist.all_reduce(tensor, group=group, async_op=True).get_future().wait()


class _Split:
    """A bucket's gradients split into compressed matrices (grouped per shape) and the rest."""

    def __init__(self, state: PowerSGDState, gradients: list[torch.Tensor]) -> None:
        self.compressed: list[torch.Tensor] = []
        self.uncompressed: list[torch.Tensor] = []
        self.p_numel = self.q_numel = 0
        for tensor in gradients:
            # A 0-dim gradient (a learned scalar, e.g. CLIP's logit_scale) is a 1 x 1 matrix; torch's raises.
            matrix = tensor.view(tensor.shape[0] if tensor.dim() else 1, -1)
            n, m = matrix.shape
            rank = min(n, m, state.matrix_approximation_rank)
            state.total_numel_before_compression += n * m
            if (n + m) * rank * state.min_compression_rate < n * m:
                self.compressed.append(matrix)
                self.p_numel += n * rank
                self.q_numel += m * rank
                state.total_numel_after_compression += (n + m) * rank
            else:
                self.uncompressed.append(tensor)
                state.total_numel_after_compression += n * m
        self.by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
        for matrix in self.compressed:
            self.by_shape[matrix.shape].append(matrix)

    def batches(self, batched: bool) -> Iterator[torch.Tensor]:
        """``[batch, n, m]`` tensors to compress: one per shape when ``batched``, else one per matrix."""
        for matrices in self.by_shape.values():
            if batched and len(matrices) > 1:
                yield torch.stack(matrices)
            else:
                yield from (matrix.unsqueeze(0) for matrix in matrices)


def _factor_views(
    batches: list[torch.Tensor], p_memory: torch.Tensor, q_memory: torch.Tensor, max_rank: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Views of the flat P and Q memory as ``[batch, n, r]`` and ``[batch, m, r]`` per batch."""
    ps, qs, p_at, q_at = [], [], 0, 0
    for batch in batches:
        size, n, m = batch.shape
        rank = min(n, m, max_rank)
        ps.append(p_memory[p_at : p_at + size * n * rank].view(size, n, rank))
        qs.append(q_memory[q_at : q_at + size * m * rank].view(size, m, rank))
        p_at += size * n * rank
        q_at += size * m * rank
    return ps, qs


def _run(
    hook: str,
    compress: Callable[[PowerSGDState, dist.GradBucket], torch.futures.Future[torch.Tensor]],
    state: object,
    bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """Both hooks: check ``state``, average plainly before ``start_powerSGD_iter``, then ``compress``."""
    checked = _check_state(state, hook)
    # Before start_powerSGD_iter, and for a bucket out of order (static_graph's first iteration
    # hands every bucket over with index 0, so the memories kept per index belong to another
    # bucket): a plain average.
    if checked.iter < checked.start_powerSGD_iter or not checked._follows(bucket):
        return _plain_average(checked, bucket)
    return compress(checked, bucket)


def _compress_matrices(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`powerSGD_hook` from ``start_powerSGD_iter`` on."""
    # Callbacks name the group through the state, never hold it: a callback's closure can be freed
    # on a gloo worker thread, which must not drop the last reference to the group (it would
    # join itself).
    group = state.process_group
    resolved = resolve_group(group)  # for this call only: no callback names it
    world = resolved.size()
    buffer, index = bucket.buffer(), bucket.index()
    gradients = bucket.gradients()
    state._check_layout(index, (buffer.numel(), tuple(tuple(g.shape) for g in gradients)))
    before = state._add_error(index, buffer)

    split = _Split(state, gradients)
    _report_stats(state, bucket)
    if split.uncompressed:
        flat_rest = torch.cat([tensor.view(-1) for tensor in split.uncompressed])
    else:
        flat_rest = buffer.new_empty(0)

    p_memory = state._memory("p_memory_dict", index, buffer)
    q_memory = state._memory("q_memory_dict", index, buffer)
    fresh = not state.warm_start or p_memory is None or q_memory is None
    if fresh:
        p_memory = state.p_memory_dict[index] = buffer.new_empty(split.p_numel)
        q_memory = state.q_memory_dict[index] = buffer.new_empty(split.q_numel)
    assert p_memory is not None
    assert q_memory is not None
    batches = list(split.batches(state.batch_tensors_with_same_shape))
    ps, qs = _factor_views(batches, p_memory, q_memory, state.matrix_approximation_rank)
    if fresh:
        generator = state._random_seed_generator()
        for q in qs:
            q.copy_(torch.randn(*q.shape, dtype=q.dtype, generator=generator))
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    q_start = _q_backup(state, q_memory)
    for batch, p, q in zip(batches, ps, qs, strict=True):
        torch.bmm(batch, q, out=p)

    def launch_rest() -> torch.futures.Future:
        return dist.all_reduce(flat_rest, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        rest = fut.value()[0].div_(world)
        at = 0
        for tensor in split.uncompressed:
            tensor.copy_(rest[at : at + tensor.numel()].view_as(tensor))
            at += tensor.numel()
        _allreduce_and_wait(p_memory, group)
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for batch, p, q in zip(batches, ps, qs, strict=True):
            torch.bmm(batch.transpose(1, 2), p, out=q)
        _allreduce_and_wait(q_memory, group)
        q_memory.div_(world)
        for p, q, batch in zip(ps, qs, batches, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=batch)
            keep_until_stream_done(batch)
        for batch in batches:
            if batch.shape[0] > 1:  # a stacked copy: write each matrix back into the bucket
                for i, matrix in enumerate(split.by_shape[batch.shape[1:]]):
                    matrix.copy_(batch[i])
        _finish(state, index, buffer, before, q_memory, q_start, p_memory)
        state.maybe_increase_iter(bucket)
        return buffer

    return state._chain.run(launch_rest, finish, drain=drains_here(bucket, resolved))


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with per-matrix PowerSGD compression (torch's ``powerSGD_hook``).

    Before ``state.start_powerSGD_iter`` it averages with a plain allreduce. Then each gradient
    matrix worth compressing (see ``min_compression_rate``) travels as its rank-r factors; the
    rest (biases, small matrices) is allreduced in one flat tensor. Three allreduces per bucket,
    one after the other.

    Example::

        >>> state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, powerSGD_hook)  # doctest: +SKIP
    """
    return _run("powerSGD_hook", _compress_matrices, state, bucket)


def _q_backup(state: PowerSGDState, q: torch.Tensor) -> torch.Tensor | None:
    """With warm start, a copy of this step's starting Q (small), restored if the step overflows."""
    return q.clone() if state.warm_start else None


def _finish(
    state: PowerSGDState,
    index: int,
    result: torch.Tensor,
    before: torch.Tensor | None,
    q: torch.Tensor,
    q_start: torch.Tensor | None,
    *used: torch.Tensor,
) -> None:
    """Keep the compression error (error feedback) and drop P/Q without warm start.

    ``before`` is the bucket's error memory from :meth:`PowerSGDState._add_error`; ``used`` were
    made in the hook and used here, maybe on another stream: their memory is kept from reuse
    until this stream is done with them. A step that overflowed (an inf or NaN in the bucket on
    any rank: its average is then not finite either, so a ``GradScaler`` skips it) would leave
    NaN in the memories and every later step NaN (torch's hooks do): there, the error restarts
    from zero and the warm-started Q keeps ``q_start``, its value at the step's start.
    """
    for tensor in (q, q_start, *used):
        if tensor is not None:
            keep_until_stream_done(tensor)
    if before is not None:  # the error memory, holding the input plus the carried error
        state.error_dict[index] = before.sub_(result).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if q_start is not None:
        torch.where(torch.isfinite(q), q, q_start, out=q)
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()


def _compress_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`batched_powerSGD_hook` from ``start_powerSGD_iter`` on."""
    buffer, index = bucket.buffer(), bucket.index()
    numel = buffer.numel()
    group = state.process_group  # not held by the callbacks (see _compress_matrices)
    resolved = resolve_group(group)  # for this call only: no callback names it
    world = resolved.size()
    side = math.ceil(math.sqrt(numel))
    # A square of side < r has at most ``side`` independent columns: more would make Q's columns
    # dependent (Gram-Schmidt divides 0 by 0) or give QR the wrong shapes.
    rank = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += numel
    state.total_numel_after_compression += side * rank * 2
    _report_stats(state, bucket)
    state._check_layout(index, (numel,))

    square = buffer.new_zeros(side * side)
    square[:numel].copy_(buffer)
    before = state._add_error(index, square)
    matrix = square.view(side, side)

    p = state._memory("p_memory_dict", index, buffer)
    q = state._memory("q_memory_dict", index, buffer)
    if not state.warm_start or p is None or q is None:
        p = state.p_memory_dict[index] = buffer.new_empty(side, rank)
        generator = state._random_seed_generator()
        q = state.q_memory_dict[index] = torch.randn(side, rank, dtype=buffer.dtype, generator=generator).to(
            buffer.device
        )
    assert p is not None
    assert q is not None
    _orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    q_start = _q_backup(state, q)
    torch.matmul(matrix, q, out=p)

    def launch_p() -> torch.futures.Future:
        return dist.all_reduce(p, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        torch.matmul(matrix.t(), p, out=q)
        _allreduce_and_wait(q, group)
        q.div_(world)
        torch.matmul(p, q.t(), out=matrix)
        _finish(state, index, square, before, q, q_start, square, p)
        buffer.copy_(square[:numel])
        state.maybe_increase_iter(bucket)
        return buffer

    return state._chain.run(launch_p, finish, drain=drains_here(bucket, resolved))


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with PowerSGD applied to the whole bucket as one square matrix.

    torch's ``batched_powerSGD_hook``: the flat bucket is zero-padded to a square of side
    ``ceil(sqrt(numel))`` and compressed at once (two allreduces per bucket). Cheaper than
    :func:`powerSGD_hook` and less accurate; ``min_compression_rate`` and
    ``batch_tensors_with_same_shape`` do not apply. Unlike torch's it never resizes the bucket
    and needs no ``cuda.synchronize``, and a bucket of side smaller than the rank (fewer than
    ``rank ** 2`` values) uses rank ``side``, which is exact (torch's raises an ``AssertionError``).

    Example::

        >>> state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, batched_powerSGD_hook)  # doctest: +SKIP
    """
    return _run("batched_powerSGD_hook", _compress_bucket, state, bucket)
