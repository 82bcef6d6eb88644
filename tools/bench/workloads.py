"""The models every training case runs on, at three sizes, and the numeric precisions.

- ``mlp-wide``: a few very wide Linear layers (each weight its own DDP bucket);
- ``mlp-deep``: 16 Linear layers with biases (32 tensors of two sizes);
- ``transformer``: GPT-shaped (token and position embeddings, pre-LN blocks with attention and
  an MLP, biases, a final LayerNorm and an LM head; 149 tensors at 12 layers);
- ``llama``: Llama-shaped, unlike the GPT in every way a layout can see (RMSNorm, rotary
  positions, a SwiGLU MLP, no biases, the LM head tied to the token embedding: one parameter used
  twice; 86 tensors at 12 layers);
- ``demo-lm``: the shape of ``hatch run demo``'s byte-level GPT (its ``small`` and ``large``
  configurations; random bytes instead of its corpus);
- ``cnn``: ResNet-34-shaped (3x3 convolutions without biases, a BatchNorm after each, residual
  blocks, a linear classifier; 110 tensors, most of them BatchNorm's small weights and biases).

Each comes in a ``large`` size (GPUs, fast link), a ``large-slow`` size (GPUs on the emulated
slow link, ~1 GB/s) and a ``small`` size (gloo on CPU, seconds per case). Precisions: ``fp32``
(TF32 off), ``tf32`` (TF32 matmuls and convolutions) and ``bf16-autocast`` (TF32 on, forward
under ``torch.autocast`` in bfloat16). Every rank builds the same model (seeded) and its own
batch (seeded by rank), so gradients differ between ranks.

Example::

    >>> workload = WORKLOADS["transformer"]["small"]
    >>> model = workload.build(torch.device("cpu"))
    >>> len(list(model.parameters())) >= 20
    True
    >>> llama = WORKLOADS["llama"]["small"].build(torch.device("cpu"))
    >>> llama.head.weight is llama.token.weight  # one parameter, used twice
    True
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRECISIONS",
    "SIZE_TIERS",
    "WORKLOADS",
    "CNNWorkload",
    "LlamaWorkload",
    "MLPWorkload",
    "TransformerWorkload",
    "Workload",
    "precision_scope",
]

PRECISIONS = ("fp32", "tf32", "bf16-autocast")
SIZE_TIERS = ("large", "large-slow", "small")

Batch = tuple[torch.Tensor, torch.Tensor]


def _batch_generator() -> torch.Generator:
    """A CPU generator seeded by this rank: each rank its own batch, the same one every run."""
    return torch.Generator().manual_seed(1000 + (dist.get_rank() if dist.is_initialized() else 0))


def set_tf32(enabled: bool) -> None:
    """TF32 matmuls (and cuDNN convolutions) on or off for the whole process."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


@contextlib.contextmanager
def precision_scope(precision: str, device: torch.device):
    """Run a forward pass in ``precision`` (TF32 is set process-wide; autocast only inside)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16-autocast":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


@dataclass(frozen=True)
class MLPWorkload:
    """``depth`` Linear layers of ``width`` x ``width`` (with biases), ReLU between, squared loss."""

    name: str
    width: int
    depth: int
    batch: int

    unit_types: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)
    """Module types that FSDP wraps (or ``fully_shard`` shards) as one unit each."""

    @property
    def parameters(self) -> int:
        return self.depth * (self.width * self.width + self.width)

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for index in range(self.depth):
            layers.append(nn.Linear(self.width, self.width, device=device))
            if index < self.depth - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def make_batch(self, device: torch.device) -> Batch:
        generator = _batch_generator()
        inputs = torch.randn(self.batch, self.width, generator=generator).to(device)
        return inputs, inputs

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(batch[0]).float().square().mean()


class Block(nn.Module):
    """A pre-LN transformer block: causal self-attention and a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int, device: torch.device) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, device=device)
        self.qkv = nn.Linear(width, 3 * width, device=device)
        self.proj = nn.Linear(width, width, device=device)
        self.ln2 = nn.LayerNorm(width, device=device)
        self.fc = nn.Linear(width, 4 * width, device=device)
        self.out = nn.Linear(4 * width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and an LM head."""

    def __init__(self, vocab: int, tokens: int, width: int, layers: int, heads: int, device: torch.device) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width, device=device)
        self.position = nn.Embedding(tokens, width, device=device)
        self.blocks = nn.ModuleList(Block(width, heads, device) for _ in range(layers))
        self.ln = nn.LayerNorm(width, device=device)
        self.head = nn.Linear(width, vocab, bias=False, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass(frozen=True)
class RandomTokens:
    """What both language models share: their shape, and random tokens with next-token cross-entropy."""

    name: str
    vocab: int
    tokens: int
    width: int
    layers: int
    heads: int
    batch: int

    def make_batch(self, device: torch.device) -> Batch:
        generator = _batch_generator()
        ids = torch.randint(self.vocab, (self.batch, self.tokens + 1), generator=generator).to(device)
        return ids[:, :-1], ids[:, 1:]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())


@dataclass(frozen=True)
class TransformerWorkload(RandomTokens):
    """A GPT-shaped language model trained on random tokens with cross-entropy."""

    unit_types: ClassVar[tuple[type[nn.Module], ...]] = (Block,)

    @property
    def parameters(self) -> int:
        per_block = 12 * self.width * self.width + 13 * self.width
        return (self.vocab * 2 + self.tokens) * self.width + self.layers * per_block + 2 * self.width

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return GPT(self.vocab, self.tokens, self.width, self.layers, self.heads, device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: rotate each (first half, second half) pair of ``x``'s last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class LlamaBlock(nn.Module):
    """A pre-norm block: RMSNorm, attention with rotary positions, RMSNorm, SwiGLU; no biases."""

    def __init__(self, width: int, heads: int, hidden: int, device: torch.device) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(width, device=device)
        self.qkv = nn.Linear(width, 3 * width, bias=False, device=device)
        self.proj = nn.Linear(width, width, bias=False, device=device)
        self.mlp_norm = nn.RMSNorm(width, device=device)
        self.gate = nn.Linear(width, hidden, bias=False, device=device)
        self.up = nn.Linear(width, hidden, bias=False, device=device)
        self.down = nn.Linear(hidden, width, bias=False, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    """A token embedding, ``layers`` Llama blocks, a final RMSNorm and an LM head tied to the embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, hidden: int, device: torch.device) -> None:
        super().__init__()
        self.heads = heads
        self.token = nn.Embedding(vocab, width, device=device)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, hidden, device) for _ in range(layers))
        self.norm = nn.RMSNorm(width, device=device)
        self.head = nn.Linear(width, vocab, bias=False, device=device)
        self.head.weight = self.token.weight
        nn.init.normal_(self.token.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        half = self.token.embedding_dim // self.heads // 2
        frequencies = 10000.0 ** (-torch.arange(half, device=ids.device) / half)
        angles = torch.outer(torch.arange(ids.shape[1], device=ids.device), frequencies)
        cos, sin = angles.cos(), angles.sin()
        x = self.token(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class LlamaWorkload(RandomTokens):
    """A Llama-shaped language model trained on random tokens with cross-entropy; ``hidden``: SwiGLU's width."""

    hidden: int

    unit_types: ClassVar[tuple[type[nn.Module], ...]] = (LlamaBlock,)

    @property
    def parameters(self) -> int:
        per_block = 4 * self.width * self.width + 3 * self.width * self.hidden + 2 * self.width
        return self.vocab * self.width + self.layers * per_block + self.width

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return Llama(self.vocab, self.width, self.layers, self.heads, self.hidden, device)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions, each followed by BatchNorm, with a (strided, projected) shortcut."""

    def __init__(self, channels_in: int, channels: int, stride: int, device: torch.device) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False, device=device)
        self.bn1 = nn.BatchNorm2d(channels, device=device)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False, device=device)
        self.bn2 = nn.BatchNorm2d(channels, device=device)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False, device=device),
                nn.BatchNorm2d(channels, device=device),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


@dataclass(frozen=True)
class CNNWorkload:
    """A ResNet-shaped image classifier (strided stem, four stages) on random images and labels."""

    name: str
    widths: tuple[int, ...]
    blocks: tuple[int, ...]
    image: int
    classes: int
    batch: int

    unit_types: ClassVar[tuple[type[nn.Module], ...]] = (ResidualBlock,)

    @property
    def parameters(self) -> int:
        with torch.random.fork_rng(devices=[]):  # build() seeds the global generator
            return sum(p.numel() for p in self.build(torch.device("meta")).parameters())

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [
            nn.Conv2d(3, self.widths[0], 3, 2, 1, bias=False, device=device),
            nn.BatchNorm2d(self.widths[0], device=device),
            nn.ReLU(),
        ]
        channels = self.widths[0]
        for stage, (width, count) in enumerate(zip(self.widths, self.blocks, strict=True)):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(ResidualBlock(channels, width, stride, device))
                channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, self.classes, device=device)]
        return nn.Sequential(*layers)

    def make_batch(self, device: torch.device) -> Batch:
        generator = _batch_generator()
        images = torch.randn(self.batch, 3, self.image, self.image, generator=generator).to(device)
        labels = torch.randint(self.classes, (self.batch,), generator=generator).to(device)
        return images, labels

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).float(), batch[1])


Workload = MLPWorkload | TransformerWorkload | LlamaWorkload | CNNWorkload

_DEMO_LM_LARGE = TransformerWorkload("demo-lm", vocab=256, tokens=256, width=384, layers=6, heads=6, batch=32)

WORKLOADS: dict[str, dict[str, Workload]] = {
    "mlp-wide": {
        # 4 x 8192^2: 268M parameters, 1 GiB of fp32 gradients in 4 buckets of 256 MiB.
        "large": MLPWorkload("mlp-wide", width=8192, depth=4, batch=64),
        "large-slow": MLPWorkload("mlp-wide", width=2048, depth=4, batch=64),
        "small": MLPWorkload("mlp-wide", width=256, depth=3, batch=16),
    },
    "mlp-deep": {
        # 16 x 4096^2 with biases: 268M parameters in 32 tensors.
        "large": MLPWorkload("mlp-deep", width=4096, depth=16, batch=256),
        "large-slow": MLPWorkload("mlp-deep", width=1024, depth=16, batch=256),
        "small": MLPWorkload("mlp-deep", width=64, depth=16, batch=32),
    },
    "transformer": {
        # 12 layers, d_model 1024, 32K vocabulary: 218M parameters in 149 tensors, 8 x 512 tokens.
        "large": TransformerWorkload("transformer", vocab=32768, tokens=512, width=1024, layers=12, heads=16, batch=8),
        "large-slow": TransformerWorkload(
            "transformer", vocab=8192, tokens=512, width=512, layers=12, heads=8, batch=8
        ),
        "small": TransformerWorkload("transformer", vocab=256, tokens=32, width=64, layers=2, heads=4, batch=4),
    },
    "gpt-deep": {
        # 48 narrow layers, d_model 384: 92M parameters in 581 tensors, 16 x 256 tokens. Hundreds of
        # small tensors per bucket: what per-tensor host work costs (held out, like the llama).
        "large": TransformerWorkload("gpt-deep", vocab=8192, tokens=256, width=384, layers=48, heads=6, batch=16),
        "large-slow": TransformerWorkload("gpt-deep", vocab=4096, tokens=256, width=256, layers=48, heads=4, batch=16),
        "small": TransformerWorkload("gpt-deep", vocab=256, tokens=16, width=32, layers=12, heads=4, batch=4),
    },
    "llama": {
        # 12 layers, d_model 1024, SwiGLU 2816, 32000 tokens tied: 187M parameters in 86 tensors, 8 x 512 tokens.
        "large": LlamaWorkload("llama", vocab=32000, tokens=512, width=1024, layers=12, heads=16, hidden=2816, batch=8),
        "large-slow": LlamaWorkload(
            "llama", vocab=8000, tokens=512, width=512, layers=12, heads=8, hidden=1408, batch=8
        ),
        "small": LlamaWorkload("llama", vocab=256, tokens=32, width=64, layers=2, heads=4, hidden=176, batch=4),
    },
    "demo-lm": {
        # tools/demo_lm's TinyGPT: 256 byte tokens, no output bias; small is the demo's default model.
        "large": _DEMO_LM_LARGE,
        "large-slow": _DEMO_LM_LARGE,  # no smaller one: the demo runs this size on either link
        "small": TransformerWorkload("demo-lm", vocab=256, tokens=64, width=64, layers=2, heads=4, batch=8),
    },
    "cnn": {
        # ResNet-34's stages (3, 4, 6, 3 blocks): 21M parameters in 110 tensors, 64 images of 64 px.
        "large": CNNWorkload("cnn", widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3), image=64, classes=100, batch=64),
        "large-slow": CNNWorkload(
            "cnn", widths=(32, 64, 128, 256), blocks=(3, 4, 6, 3), image=32, classes=100, batch=64
        ),
        "small": CNNWorkload("cnn", widths=(8, 16, 16, 32), blocks=(1, 2, 2, 1), image=16, classes=10, batch=4),
    },
}


def parameter_mib(workload: Workload) -> float:
    return round(workload.parameters * 4 / 2**20, 1)
