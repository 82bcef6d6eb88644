"""ZeRO's reduce_scatter=True send buffers: a bucket's runs divided by the world size into them,
with the compress hooks' arithmetic (torch's cast-then-divide from a bf16 bucket into fp16)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dcomm.ddp._zero.sharded_driver import ShardedDriver, _Piece


def divided(buffer: torch.Tensor, send_dtype: torch.dtype, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    send = torch.zeros(buffer.numel() + 4, dtype=send_dtype)
    piece = _Piece(SimpleNamespace(send=send), len(runs), runs)  # type: ignore[arg-type]
    ShardedDriver._divide_into_send(SimpleNamespace(world=3), piece, buffer)  # type: ignore[arg-type]
    return send


@pytest.mark.parametrize("runs", [[(0, 0, 600)], [(0, 4, 250), (250, 0, 4), (254, 254, 346)]])
@pytest.mark.parametrize(
    ("bucket", "sent"),
    [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_runs_divided_into_the_send_buffer_as_the_hooks_do(
    runs: list[tuple[int, int, int]], bucket: torch.dtype, sent: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(1)
    buffer = (torch.randn(600, generator=generator, dtype=torch.float64) * 0.01).to(bucket)
    send = divided(buffer, sent, runs)
    for src, dst, numel in runs:
        piece = buffer[src : src + numel]
        # From fp32 the division comes before the cast; from fp16/bf16 after it, as in torch's hooks.
        want = (piece / 3).to(sent) if bucket == torch.float32 else piece.to(sent).div_(3)
        assert torch.equal(send[dst : dst + numel], want), (bucket, sent, runs)
    written = sum(numel for _, _, numel in runs)
    assert int((send != 0).sum()) <= written  # nothing outside the runs
