"""Hugging Face checkpoint I/O for MoETransformer: streaming load and sharded save of safetensors.

The layout maps every Hugging Face tensor name to a (parameter, index) pair of the model, so that
one checkpoint tensor is copied straight into its slot: per-expert ``experts.{e}.gate_proj`` lands
in rows ``[e, :I]`` of the fused ``w13[E, 2I, D]``. Loading builds the model on the meta device,
allocates it once and fills it tensor by tensor from memory-mapped files: never two full copies of
the weights. Saving writes views of the parameters, one shard at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from .config import MoETransformerConfig, UnsupportedCheckpointError

EXPERT_FORMATS = ("unfused", "fused")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes (missing/unexpected tensors, shapes)."""


@contextlib.contextmanager
def open_safetensors(path, device: str = "cpu"):
    """``safetensors.safe_open`` whose read errors (a truncated or corrupt file) name the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), "pt", device=device) as st:
            yield st
    except SafetensorError as e:
        raise CheckpointError(f"{os.fspath(path)}: not a readable safetensors file ({e})") from e


def read_safetensors(path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (``safetensors.torch.load_file``; errors name the file)."""
    with open_safetensors(path, device) as st:
        return {k: st.get_tensor(k) for k in st.keys()}


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives in the model: ``param[index]``."""

    param: str
    index: tuple = ()


def _layer_slots(model, i: int, expert_format: str) -> dict[str, Slot]:
    cfg: MoETransformerConfig = model.config
    layer = model.layers[i]
    src, hf = f"layers.{i}", f"model.layers.{i}"
    out = {
        f"{hf}.input_layernorm.weight": Slot(f"{src}.attention_norm.weight"),
        f"{hf}.post_attention_layernorm.weight": Slot(f"{src}.ffn_norm.weight"),
    }
    if cfg.is_mla:  # MLA parameters carry Hugging Face's names: one to one under self_attn
        for name, _ in layer.attention.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("lora_"):  # LoRA adapters: saved by save_lora, not here
                continue
            out[f"{hf}.self_attn.{name}"] = Slot(f"{src}.attention.{name}")
        return _ffn_slots(out, layer, src, hf, cfg, expert_format)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(layer.attention, proj)
        out[f"{hf}.self_attn.{proj}.weight"] = Slot(f"{src}.attention.{proj}.weight")
        if lin.bias is not None:
            out[f"{hf}.self_attn.{proj}.bias"] = Slot(f"{src}.attention.{proj}.bias")
    if cfg.qk_norm:
        out[f"{hf}.self_attn.q_norm.weight"] = Slot(f"{src}.attention.q_norm.weight")
        out[f"{hf}.self_attn.k_norm.weight"] = Slot(f"{src}.attention.k_norm.weight")
    return _ffn_slots(out, layer, src, hf, cfg, expert_format)


def _ffn_slots(out: dict[str, Slot], layer, src: str, hf: str, cfg: MoETransformerConfig,
               expert_format: str) -> dict[str, Slot]:
    if not layer.is_moe:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}.mlp.{proj}.weight"] = Slot(f"{src}.ffn.{proj}.weight")
        return out
    out.update(_moe_slots(layer.ffn, f"{src}.ffn", f"{hf}.mlp", cfg, expert_format))
    return out


def _moe_slots(moe: nn.Module, src: str, hf: str, cfg: MoETransformerConfig, expert_format: str) -> dict[str, Slot]:
    n = moe_param_names(moe)
    inter = cfg.moe_dim
    out = {f"{hf}.gate.weight": Slot(f"{src}.{n['router']}")}
    if cfg.use_expert_bias:
        out[f"{hf}.gate.e_score_correction_bias"] = Slot(f"{src}.{n['expert_bias']}")
    if expert_format == "fused":
        out[f"{hf}.experts.gate_up_proj"] = Slot(f"{src}.{n['w13']}")
        out[f"{hf}.experts.down_proj"] = Slot(f"{src}.{n['w2']}")
    else:
        for e in range(cfg.num_experts):
            out[f"{hf}.experts.{e}.gate_proj.weight"] = Slot(f"{src}.{n['w13']}", (e, slice(0, inter)))
            out[f"{hf}.experts.{e}.up_proj.weight"] = Slot(f"{src}.{n['w13']}", (e, slice(inter, 2 * inter)))
            out[f"{hf}.experts.{e}.down_proj.weight"] = Slot(f"{src}.{n['w2']}", (e,))
    if cfg.num_shared_experts:
        shared = cfg.num_shared_experts * inter
        if "shared_w13" in n:
            out[f"{hf}.shared_experts.gate_proj.weight"] = Slot(f"{src}.{n['shared_w13']}", (slice(0, shared),))
            out[f"{hf}.shared_experts.up_proj.weight"] = Slot(f"{src}.{n['shared_w13']}", (slice(shared, 2 * shared),))
            out[f"{hf}.shared_experts.down_proj.weight"] = Slot(f"{src}.{n['shared_w2']}")
        else:
            for proj in ("gate", "up", "down"):
                out[f"{hf}.shared_experts.{proj}_proj.weight"] = Slot(f"{src}.{n['shared_' + proj]}")
    return out


def moe_param_names(moe: nn.Module) -> dict[str, str]:
    """Names (relative to the MoE module) of the tensors the checkpoint layout needs."""
    names = {n for n, _ in moe.named_parameters()} | {n for n, _ in moe.named_buffers()}

    def pick(role, *candidates):
        for c in candidates:
            if c in names:
                return c
        return None

    found = {
        "router": pick("router", "router.weight", "gate.weight", "router.gate.weight"),
        "expert_bias": pick("expert_bias", "expert_bias", "router.expert_bias"),
        "w13": pick("w13", "w13", "experts.w13"),
        "w2": pick("w2", "w2", "experts.w2"),
        "shared_w13": pick("shared_w13", "shared_w13", "shared_experts.w13"),
        "shared_w2": pick("shared_w2", "shared_w2", "shared_experts.w2"),
        "shared_gate": pick("shared_gate", "shared_experts.gate_proj.weight", "shared_expert.gate_proj.weight"),
        "shared_up": pick("shared_up", "shared_experts.up_proj.weight", "shared_expert.up_proj.weight"),
        "shared_down": pick("shared_down", "shared_experts.down_proj.weight", "shared_expert.down_proj.weight"),
    }
    return {k: v for k, v in found.items() if v is not None}


def hf_layout(model, expert_format: str = "unfused") -> dict[str, Slot]:
    """Every Hugging Face tensor name of ``model``'s checkpoint -> its :class:`Slot`."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    out = {"model.embed_tokens.weight": Slot("embed.weight")}
    for i in range(model.config.n_layers):
        out.update(_layer_slots(model, i, expert_format))
    out["model.norm.weight"] = Slot("norm.weight")
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = Slot("lm_head.weight")
    return out


# ---------------------------------------------------------------------------------------------------
def _checkpoint_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{index} names shard {name!r}, which is missing from {path}")
        return [os.path.join(path, f) for f in files], weight_map
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        return [single], None
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors weights in {path} (expected {_SINGLE} or {_INDEX})")
    return [os.path.join(path, f) for f in found], None


def _all_keys(files: list[str]) -> list[str]:
    keys = []
    for f in files:
        with open_safetensors(f) as st:
            keys.extend(st.keys())
    return keys


_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _detect_expert_format(keys) -> str:
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)
    unfused = any(re.search(r"\.mlp\.experts\.\d+\.gate_proj\.weight$", k) for k in keys)
    if fused and unfused:
        raise CheckpointError("checkpoint mixes fused (experts.gate_up_proj) and per-expert expert tensors")
    return "fused" if fused else "unfused"


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedCheckpointError(f"unknown dtype {name!r} in config.json")
    return dt


def _fp32_params(model) -> set[str]:
    """Router weights and expert biases stay in float32 (routing decisions are precision-sensitive;
    Hugging Face keeps GLM's gate in float32 too)."""
    out = set()
    for i, layer in enumerate(model.layers):
        if getattr(layer.attention, "indexer", None) is not None:  # Hugging Face keeps it in float32
            out.add(f"layers.{i}.attention.indexer.weights_proj.weight")
        if layer.is_moe:
            n = moe_param_names(layer.ffn)
            for role in ("router", "expert_bias"):
                if role in n:
                    out.add(f"layers.{i}.ffn.{n[role]}")
    return out


def load_pretrained(cls, path, *, dtype: torch.dtype | None = None, device="cpu"):
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = MoETransformerConfig.from_hf(path)
    files, _ = _checkpoint_files(path)
    keys = _all_keys(files)
    expert_format = _detect_expert_format(keys)
    dtype = dtype or _dtype_from_name(config.dtype)

    with torch.device("meta"):
        model = cls(config)
    fp32 = _fp32_params(model)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        # to_empty makes new Parameters when moving off the meta device, which unties them.
        model.lm_head.weight = model.embed.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name in fp32 else dtype)
        for name, b in model.named_buffers():
            if b.is_floating_point():
                b.data = b.data.to(torch.float32)
            b.zero_()  # buffers not in the checkpoint (e.g. load counters) start at zero

    layout = hf_layout(model, expert_format)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    unexpected, skipped = [], []
    with torch.no_grad():
        for f in files:
            with open_safetensors(f) as st:
                for key in st.keys():
                    slot = layout.get(key)
                    if slot is None:
                        m = _MTP_LAYER.match(key)
                        if key == "lm_head.weight" and config.tie_word_embeddings:
                            skipped.append(key)  # a tied head saved anyway: the embedding is the head
                        elif m and int(m.group(1)) >= config.n_layers:
                            skipped.append(key)  # multi-token-prediction layers: not part of the model
                        else:
                            unexpected.append(key)
                        continue
                    target = params[slot.param][slot.index] if slot.index else params[slot.param]
                    shape = tuple(st.get_slice(key).get_shape())
                    if shape != tuple(target.shape):
                        raise CheckpointError(f"shape mismatch for {key!r} in {os.path.basename(f)}: checkpoint has "
                                              f"{shape}, the model ({config.family}) expects {tuple(target.shape)}")
                    target.copy_(st.get_tensor(key))
                    loaded.add(key)
    missing = sorted(set(layout) - loaded)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            more = " ..." if len(unexpected) > 8 else ""
            parts.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:8]}{more}")
        raise CheckpointError(f"checkpoint {path} does not match its {config.family} config: " + "; ".join(parts))
    model._expert_format = expert_format
    model._skipped_checkpoint_tensors = skipped
    return model


# ---------------------------------------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP / EP sharded): gather this one tensor
        t = t.full_tensor()
    return t.detach()


def save_pretrained(model, path, *, expert_format: str | None = None, max_shard_size: int = 5 * 2**30) -> None:
    from safetensors.torch import save_file

    expert_format = expert_format or getattr(model, "_expert_format", "unfused")
    for layer in model.moe_layers:
        if layer.ffn.dispatcher is not None:
            raise ValueError("save_pretrained: this model's experts are split by expert parallelism (each rank holds "
                             "only its experts); save from an unparallelized model or gather the experts first")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    # FSDP-sharded parameters are gathered one tensor at a time (a collective: every rank calls
    # save_pretrained); only global rank 0 writes.
    writer = not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0
    path = os.fspath(path)
    if writer:
        os.makedirs(path, exist_ok=True)
    layout = hf_layout(model, expert_format)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers()))

    def tensor_of(key):
        slot = layout[key]
        t = _full(tensors[slot.param])
        return (t[slot.index] if slot.index else t).contiguous().cpu()

    shards: list[list[str]] = [[]]
    size = 0
    total = 0
    for key, slot in layout.items():
        t = tensors[slot.param]
        view = torch.empty(t.shape, device="meta")  # global shape, also for a sharded DTensor
        nbytes = (view[slot.index] if slot.index else view).numel() * t.element_size()
        total += nbytes
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes

    if writer:
        for name in os.listdir(path):  # stale shards of an earlier save would be picked up on load
            if name.endswith(".safetensors") or name == _INDEX:
                os.remove(os.path.join(path, name))
    weight_map = {}
    for n, keys in enumerate(shards):
        fname = _SINGLE if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {k: tensor_of(k) for k in keys}
        if writer:
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if not writer:
        return
    if len(shards) > 1:
        with open(os.path.join(path, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2, sort_keys=True)
