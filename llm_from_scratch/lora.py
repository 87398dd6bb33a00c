"""LoRA: low-rank adapters on a frozen model, and the reference policy for free (appendix A).

A linear layer y = x Wᵀ + b (W: (out, in)) keeps W and b frozen and learns a low-rank change of W:

    y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ          A: (r, in), B: (out, r), r ≪ min(in, out)

so a layer trains r · (in + out) numbers instead of in · out. A starts random (as nn.Linear's weight) and B at zero:
at step 0 the product B A is zero and the model is exactly the base model. The scale α / r keeps the size of the
update comparable when r changes (tune the learning rate once, then vary r).

- `merge` folds the update into the weight, W ← W + (α/r) B A, so the adapted model runs at the base model's cost;
  `unmerge` takes it out again, W ← W − (α/r) B A (equal up to float rounding).
- `adapters_disabled(model)` switches every adapter off: inside it the model computes the base model exactly. In RL
  and DPO the base model is the SFT model, which is the reference policy π_ref; so `AdaptersOff(model)` serves as the
  reference with no second copy of the weights: one network, two policies.
- Only A and B get gradients; the base weights, the embeddings and the LayerNorms stay frozen, so the optimizer keeps
  state for the adapters alone (AdamW: two numbers per trained number), and no gradient of the base is ever stored.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from llm_from_scratch.checkpoint import save_model, save_tensors

# --lora-targets: which linear layers of the GPT get adapters (names as in model.py and attention.py)
TARGETS = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj"),
           "all": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (α / r) B A; B = 0 at the start."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRALinear: rank must be ≥ 1, got {rank}")
        self.base = base.requires_grad_(False)
        out_features, in_features = base.weight.shape
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **factory))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, **factory))  # (out, r): the update starts at 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own initialisation of a weight
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.enabled = True  # False inside adapters_disabled(): the base layer alone
        self.merged = False  # True after merge(): W already holds the update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out): y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ, the frozen layer plus the low-rank
        update; the base layer alone when the adapter is switched off, or when merged (W then holds the update)."""
        y = self.base(x)
        if self.enabled and not self.merged:
            y = y + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scale  # (..., r) then (..., out)
        return y

    def delta_weight(self) -> torch.Tensor:
        """The update of W as one (out, in) matrix: (α / r) B A."""
        return (self.lora_B @ self.lora_A) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        """W ← W + (α/r) B A: the adapted layer at the base layer's cost (A and B are kept, for unmerge)."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W ← W − (α/r) B A: the base weight back (up to float rounding), the update applied on the side again."""
        if self.merged:
            self.base.weight -= self.delta_weight()
            self.merged = False

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def adapted_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRALinear layers by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: str | tuple[str, ...] = "all",
               dropout: float = 0.0) -> nn.Module:
    """Freeze every parameter of `model` and put a LoRALinear on each nn.Linear whose name ends with one of
    `targets` ("attn", "mlp", "all", or a tuple of name endings such as ("attn.c_attn",)). alpha defaults to 2 · rank
    (scale 2). In place; returns the model."""
    if adapted_layers(model):
        raise ValueError("apply_lora: the model already has adapters")
    if isinstance(targets, str) and targets not in TARGETS:
        raise ValueError(f"apply_lora: targets={targets!r}: choose one of {', '.join(TARGETS)} or name endings")
    endings = TARGETS[targets] if isinstance(targets, str) else tuple(targets)
    alpha = 2.0 * rank if alpha is None else alpha
    model.requires_grad_(False)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.endswith(endings)]
    if not chosen:
        raise ValueError(f"apply_lora: no nn.Linear of the model ends with any of {endings}")
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha, dropout))
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that get gradients (after apply_lora: every A and B, nothing else)."""
    return [p for p in model.parameters() if p.requires_grad]


def merge(model: nn.Module) -> None:
    """Fold every adapter into its weight (LoRALinear.merge)."""
    for layer in adapted_layers(model).values():
        layer.merge()


def unmerge(model: nn.Module) -> None:
    """Take every adapter out of its weight again (LoRALinear.unmerge)."""
    for layer in adapted_layers(model).values():
        layer.unmerge()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Every adapter off inside the block: the model is its base model (the reference policy). Restored after, even on
    an error. A merged adapter is inside its weight and cannot be switched off: unmerge first."""
    layers = list(adapted_layers(model).values())
    if any(layer.merged for layer in layers):
        raise RuntimeError("adapters_disabled: some adapters are merged into their weights; call lora.unmerge first")
    was = [layer.enabled for layer in layers]
    try:
        for layer in layers:
            layer.enabled = False
        yield model
    finally:
        for layer, enabled in zip(layers, was):
            layer.enabled = enabled


class AdaptersOff(nn.Module):
    """The base model of a LoRA model, seen through it: every call runs with the adapters off. It holds no weights of
    its own (its parameters are the model's), so as the reference policy of RL or DPO it costs no second copy. Use it
    only without gradients, as a reference is used."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def trunk(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model.trunk(*args, **kwargs)


class Adapters(nn.Module):
    """The adapters of a model alone, as a module: its state dict holds every A and B (the model's own tensors, under
    names with "." written "__"), and loading one writes into the model. What a LoRA run saves to resume: a few
    kilobytes where the whole model would be megabytes or gigabytes."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tensors = nn.ParameterDict({name.replace(".", "__"): p for name, p in model.named_parameters()
                                         if name.endswith(("lora_A", "lora_B"))})


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter folded in (W + (α/r) B A; A and B themselves left out), under
    the names the model had before apply_lora: a checkpoint any code that knows the base model can load. The model
    is not changed."""
    layers = adapted_layers(model)
    state = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in layers and leaf in ("lora_A", "lora_B"):
            continue
        if owner.endswith(".base") and owner[: -len(".base")] in layers:
            layer = layers[owner[: -len(".base")]]
            plain = f"{owner[: -len('.base')]}.{leaf}"
            if leaf == "weight" and not layer.merged:
                tensor = tensor + layer.delta_weight().detach().to(tensor.dtype)
            state[plain] = tensor
        else:
            state[name] = tensor
    return state


def save_merged(model: nn.Module, folder: str | Path) -> Path:
    """An adapted GPT as a plain GPT checkpoint (kind "gpt", the adapters folded in: what every chapter loads), and
    the adapters alone beside it, `adapters.safetensors` (rank, alpha and the adapted layers in its metadata): what a
    LoRA user ships, a few kilobytes on top of a base model everyone has."""
    layers = adapted_layers(model)
    if not layers:
        raise ValueError("save_merged: the model has no adapters")
    folder = Path(folder)
    save_model(model, folder, "gpt", asdict(model.config), state=merged_state_dict(model))
    first = next(iter(layers.values()))
    save_tensors(folder / "adapters.safetensors", Adapters(model).state_dict(),
                 {"rank": str(first.rank), "alpha": str(first.alpha), "layers": json.dumps(sorted(layers))})
    return folder
