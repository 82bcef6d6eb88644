"""fp16_compress_wrapper / bf16_compress_wrapper against torch's, trained side by side on gloo ranks.

Every rank gets its own batches, so parameters agree across ranks only when the wrapped hook
averaged. dcomm's wrappers do torch's arithmetic (cast, the wrapped hook in low precision, cast
back), so the parameters equal torch's bit for bit; against a float32 allreduce they agree within
5e-3 (fp16) / 2.5e-2 (bf16) of each parameter's change over the run (at world 3 the division by
3 rounds in fp16 too).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_plsgd

from dcomm.ddp import (
    PostLocalSGDState,
    allreduce_hook,
    bf16_compress_wrapper,
    fp16_compress_wrapper,
    post_localSGD_hook,
)
from dcomm_testing import (
    assert_close,
    assert_same_on_ranks,
    assert_updates_close,
    run_ranks,
    seeded_batch,
    seeded_mlp,
    train_ddp,
)

STEPS = 4
RTOL = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
BUCKET_CAPS = [0.0003] * 8  # several buckets per step


def train(hook, state: object, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = seeded_mlp(6, 12, 3, dtype=dtype)
    batch = functools.partial(seeded_batch, rank, shape=(5, 6), draw=torch.float32, dtype=dtype)
    return train_ddp(model, hook, state, batch, STEPS, bucket_cap_mb_list=BUCKET_CAPS)


def torch_wrapper(dtype: torch.dtype, hook):
    wrapped = (torch_hooks.fp16_compress_wrapper if dtype == torch.float16 else torch_hooks.bf16_compress_wrapper)(hook)

    # DDP refuses a hook named bf16_compress_wrapper_hook without NCCL; torch's runs fine on gloo.
    def torch_wrapped(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return wrapped(state, bucket)

    return torch_wrapped


def _parity(rank: int, world: int) -> None:
    fp32 = train(torch_hooks.allreduce_hook, None)
    for dtype, ours_wrapper in ((torch.float16, fp16_compress_wrapper), (torch.bfloat16, bf16_compress_wrapper)):
        rtol = RTOL[dtype]
        ours = train(ours_wrapper(allreduce_hook), None)
        assert_close(ours, train(torch_wrapper(dtype, torch_hooks.allreduce_hook), None), 0.0, f"{dtype} vs torch's")
        initial = list(seeded_mlp(6, 12, 3).parameters())
        assert_updates_close(ours, fp32, initial, rtol, f"{dtype} vs the fp32 allreduce")
        assert_same_on_ranks(ours, f"{dtype} wrapper")
        # A hook with a state of its own: post-local SGD, global for all steps here.
        state = PostLocalSGDState(None, None, start_localSGD_iter=STEPS)
        theirs = torch_plsgd.PostLocalSGDState(None, None, start_localSGD_iter=STEPS)
        ours = train(ours_wrapper(post_localSGD_hook), state)
        reference = train(torch_wrapper(dtype, torch_plsgd.post_localSGD_hook), theirs)
        assert_close(ours, reference, 0.0, f"{dtype} post-local")
        assert state.iter == theirs.iter == STEPS
    # A bucket already in the wrapper's dtype goes to the hook as it is: torch's arithmetic exactly.
    half = train(fp16_compress_wrapper(allreduce_hook), None, dtype=torch.float16)
    assert_close(half, train(torch_hooks.allreduce_hook, None, dtype=torch.float16), 0.0, "fp16 model")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_wrappers_match_torch(world: int) -> None:
    run_ranks(_parity, world, timeout=240)


def test_wrapped_hook_keeps_ddps_signature() -> None:
    hook = bf16_compress_wrapper(allreduce_hook)
    # DDP checks the annotations, and refuses hooks named like torch's bf16 hooks without NCCL.
    assert hook.__annotations__["bucket"] is dist.GradBucket
    assert hook.__annotations__["return"] == torch.futures.Future[torch.Tensor]
    assert hook.__name__ == "dcomm_bf16_compress_wrapper_hook"


@pytest.mark.parametrize("wrapper", [fp16_compress_wrapper, bf16_compress_wrapper])
def test_wrapper_rejects_non_hooks(wrapper) -> None:
    with pytest.raises(TypeError, match=rf"hook: {wrapper.__name__} expects a DDP comm hook .* got int"):
        wrapper(3)
