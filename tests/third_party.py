"""Models this project did not write (Hugging Face configs, nanoGPT-style), trained the way a user would.

Every rank is fed its own slice of the global batch (DistributedSampler's contract), and
the parameters after a few steps are compared with torch DDP on the same slices. Nothing
is downloaded: the Hugging Face models are built from small random configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 5
ROWS_PER_RANK = 2
SEQ = 8
VOCAB = 64


def _config(name: str):
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    if name == "llama":
        return tf.LlamaConfig(**small, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=32)
    if name == "bert":
        return tf.BertConfig(**small, num_hidden_layers=2, max_position_embeddings=32, type_vocab_size=1)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    if name == "t5":
        return tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    if name == "mixtral":
        return tf.MixtralConfig(
            **small, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32,
        )
    if name == "qwen3_moe":  # its load-balancing loss in the loss (output_router_logits)
        return tf.Qwen3MoeConfig(
            **small, moe_intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
            max_position_embeddings=32,
        )
    raise KeyError(name)


def _hf(name: str) -> nn.Module:
    """Dropout off everywhere, also where a model calls F.dropout with a rate from its config
    (T5's attention): with it on, ranks draw different masks than DDP and only statistics compare."""
    import transformers as tf

    config = _config(name)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(config, key, 0.0)
    model_class = {
        "llama": tf.LlamaForCausalLM, "bert": tf.BertForMaskedLM, "gpt2": tf.GPT2LMHeadModel,
        "t5": tf.T5ForConditionalGeneration, "mixtral": tf.MixtralForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
    }[name]
    model = model_class(config)
    if torch.get_default_dtype() == torch.float64 and name in ("llama", "gpt2", "mixtral", "qwen3_moe"):
        model.loss_function = causal_loss_in_logits_dtype
    return model


def causal_loss_in_logits_dtype(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                                shift_labels: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """HF's causal-LM loss (the next token's cross-entropy; a sum over ``num_items_in_batch`` where given) in the
    logits' own dtype. HF casts the logits to float32 first, which in a float64 run rounds the loss at float32: a
    vocabulary-split log-softmax (tp's [Note: a loss over a split vocabulary]) sums in another order than one
    process's kernel, and the float32 rounding of that (1.6e-8 after 5 AdamW steps of HF Llama under tp 4) would
    hide in the float64 checks' tolerance what they exist to show. Computed in float64 the same runs agree to 2e-16."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    summed = num_items_in_batch is not None
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum" if summed else "mean")
    return loss / num_items_in_batch if summed else loss


class HuggingFaceLM(nn.Module):
    """Returns the model's own loss, as a user of ``labels=`` would."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.inner = _hf(name)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.name == "t5":
            return self.inner(input_ids=ids, attention_mask=mask, labels=labels).loss
        if self.name == "bert":
            return self.inner(input_ids=ids, attention_mask=mask, labels=labels).loss
        return self.inner(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


HF_MODELS = ("llama", "bert", "gpt2", "t5", "mixtral", "qwen3_moe")


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block, as written there: 3x3 convolutions without bias, each followed
    by BatchNorm, an in-place ReLU, the shortcut added in place (a strided 1x1 convolution + BatchNorm
    where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's resnet18 at 1/8 of its width (torchvision does not load beside torch 2.13+cpu):
    the same modules, names and initialisation (a 7x7 stem with BatchNorm and max pooling, four stages
    of two basic blocks, average pooling, a classifier; 62 parameters and 40 buffers). The batch's
    token ids are drawn as 64x64 images; the loss is cross entropy on a class taken from each row."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        cin = width
        for stage, cout in enumerate(widths, start=1):
            stride = 1 if stage == 1 else 2
            setattr(self, f"layer{stage}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        self.classes = classes
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        images = (ids.float() / VOCAB).repeat_interleave(3 * IMAGE * IMAGE // SEQ, 1).view(-1, 3, IMAGE, IMAGE)
        images = images + torch.linspace(-1, 1, IMAGE * IMAGE).view(1, 1, IMAGE, IMAGE)
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        return nn.functional.cross_entropy(logits, ids[:, 0] % self.classes)


IMAGE = 64  # at 32x32 the last stage's BatchNorm sees 2 values per channel and amplifies rounding to O(1):
# [Note: a BatchNorm over two values amplifies rounding] in tests/test_tensor_parallel_convnets.py


class CausalSDPA(nn.Module):
    """torchtitan's inner-attention contract ((B, L, heads, head_dim) in and out) over torch's causal
    SDPA: flex attention, torchtitan 0.3's only choice for language models, has no CPU backward."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs) -> torch.Tensor:
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


TORCHTITAN_MODELS = ("titan_llama3", "titan_deepseek", "titan_qwen3_moe")


def needs_torchtitan(name: str) -> None:
    """Skip a test of a torchtitan model where its code is not installed (tests/requirements-torchtitan.txt),
    except under CI, which installs it: there a missing install fails the test."""
    if name in TORCHTITAN_MODELS and not os.environ.get("CI"):
        import pytest

        pytest.importorskip("torchtitan")


class TorchtitanLM(nn.Module):
    """torchtitan 0.3.0's own model code (its ``debugmodel`` flavours: RoPE, GQA or MLA, routed
    experts), each layer's inner attention causal SDPA, with the causal LM loss over the unmasked
    tokens as torchtitan's trainer computes it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        flavor = "debugmodel"
        if name == "titan_llama3":
            from torchtitan.models.llama3 import model_registry
        elif name == "titan_qwen3_moe":
            from torchtitan.models.qwen3 import model_registry

            flavor = "debugmodel_moe"
        else:
            from torchtitan.models.deepseek_v3 import model_registry
        self.inner = model_registry(flavor).model.build()
        for layer in self.inner.layers.values():
            layer.attention.inner_attention = CausalSDPA()
        with torch.no_grad():
            self.inner.init_weights(buffer_device=None)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.inner(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


class NanoGPTLM(nn.Module):
    """nanoGPT's model (examples/gpt.py, tied LM head), optionally under CPU bf16 autocast."""

    def __init__(self, autocast: bool = False, block_size: int = 16) -> None:
        super().__init__()
        from gpt import GPT, GPTConfig

        self.inner = GPT(GPTConfig(vocab_size=VOCAB, block_size=block_size, n_layer=2, n_head=4, n_embd=32))
        self.autocast = autocast

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self.inner(ids, labels.masked_fill(labels < 0, 0).roll(-1, 1))


def _own_moe() -> nn.Module:
    from moe_models import OwnMoE

    return OwnMoE(vocab=VOCAB)


# Models beside the Hugging Face ones: name -> builder.
OTHER_MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet": ResNet,
    "titan_llama3": lambda: TorchtitanLM("titan_llama3"),
    "titan_deepseek": lambda: TorchtitanLM("titan_deepseek"),
    "titan_qwen3_moe": lambda: TorchtitanLM("titan_qwen3_moe"),
    "nanogpt": NanoGPTLM,
    "nanogpt_bf16": lambda: NanoGPTLM(autocast=True),
    "nanogpt_4k": lambda: NanoGPTLM(block_size=4096),
    "own_moe": lambda: _own_moe(),
}


def build(name: str) -> nn.Module:
    """``name`` seeded the same on every rank; ``gpt2_ckpt``: GPT-2 with gradient_checkpointing_enable()."""
    torch.manual_seed(0)
    if name in OTHER_MODELS:
        return OTHER_MODELS[name]()
    if name == "gpt2_ckpt":
        model = HuggingFaceLM("gpt2")
        model.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    return HuggingFaceLM(name)


def global_batch(step: int, rows: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, attention mask): the mask pads a different number of tokens per row."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for row in range(rows):
        mask[row, seq - (row % 3):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, labels, mask


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world_size)[rank] for t in batch)


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    strategy: str  # "torch_ddp" for the reference
    optimizer: str = "adamw"
    lr: float | None = None  # None: the optimizer's default below
    mesh_shape: tuple[int, ...] | None = None  # 2-D strategies: (dp, tp) or (replicate, shard)
    parallelize_kwargs: tuple[tuple[str, object], ...] = ()
    options: tuple[tuple[str, object], ...] = ()  # torch.compile(..., options=) beyond the compiler
    seq: int = SEQ  # tokens per row
    rows: int = ROWS_PER_RANK  # rows per rank
    same_rows_in: int = 1  # ranks fed the same rows: a group of this many consecutive ranks shares a slice


def _optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.05)
    return torch.optim.AdamW(params, lr=lr or 1e-3)


@contextlib.contextmanager
def float64_by_default() -> Iterator[None]:
    """Models and tensors built inside are float64, where rounding is ~1e-15 and a real gap between two runs stays
    large; float32 again after, whatever happens inside."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def nudge(model: nn.Module) -> None:
    """Every parameter moved by 1e-7 (random, seeded): torch DDP trained from these weights is the rounding
    control. Its gap from DDP is what fp32 rounding alone moves the trained parameters on this host's kernels."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-7)


def train(rank: int, world_size: int, run: Run, prepare: Callable[[nn.Module], None] | None = None) -> dict:
    """Train ``run.model`` for STEPS on this rank's slices; the full state dict (rank 0's view)."""
    import dpar
    from dpar.core.plan import Strategy
    from torch.distributed.device_mesh import init_device_mesh

    model = build(run.model)
    if prepare is not None:
        prepare(model)
    if run.strategy == "torch_ddp":
        runner = nn.parallel.DistributedDataParallel(model)
    else:
        kwargs = dict(run.parallelize_kwargs)
        if run.mesh_shape is not None:
            names = Strategy.parse(run.strategy).mesh_dim_names  # hsdp's: ("replicate", "shard")
            kwargs["mesh"] = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=names)
        example = rank_slice(global_batch(0, run.rows * world_size, run.seq), rank, world_size)
        dpar.parallelize(model, strategy=run.strategy, example_inputs=example, **kwargs)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", **dict(run.options)})
    opt = _optimizer(run.optimizer, [p for p in model.parameters() if p.requires_grad], run.lr)
    slices = world_size // run.same_rows_in
    for step in range(STEPS):
        opt.zero_grad()
        ids, labels, mask = rank_slice(global_batch(step, run.rows * slices, run.seq), rank // run.same_rows_in, slices)
        runner(ids, labels, mask).backward()
        opt.step()
    if run.strategy == "torch_ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = dpar.checkpoint.full_state_dict(model)
    dist.barrier()
    return state


def train_compiled(rank: int, world_size: int, model: nn.Module) -> dict:
    """``model`` (placed by dpar.parallelize) compiled with dpar, trained STEPS with AdamW on this rank's slices;
    its full state dict (rank 0's view)."""
    import dpar

    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = _optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        optimizer.zero_grad()
        runner(*rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)).backward()
        optimizer.step()
    return dpar.checkpoint.full_state_dict(model)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def assert_figures(found: dict[str, float | str], what: str, tolerance: float, cases: int) -> None:
    """Print each case's max |difference| from torch DDP (or the error it raised), then fail on any error
    or difference over ``tolerance``, and unless all ``cases`` reported."""
    for label, diff in found.items():
        print(f"{what}: {label}: {diff}")
    failed = {label: diff for label, diff in found.items() if isinstance(diff, str) or diff > tolerance}
    assert not failed, failed
    assert len(found) == cases
