"""``save_lora`` / ``load_lora``: a MoETransformer's LoRA adapters in PEFT's format.

A directory with ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ``target_parameters``) and ``adapter_model.safetensors`` whose keys are Hugging
Face module names under ``base_model.model.``:

    linear   <hf module>.lora_A.weight [r, in]        <hf module>.lora_B.weight [out, r]
    experts  (PEFT's ParamWrapper over the fused 3D ``gate_up_proj`` / ``down_proj``; gate_up_proj
             is the inner wrapper, hence ``base_layer``)
             model.layers.i.mlp.experts.base_layer.lora_A.weight [E*r, D]    lora_B.weight [2I, E*r]
             model.layers.i.mlp.experts.lora_A.weight            [E*r, I]    lora_B.weight [D, E*r]

PEFT's expert layout: expert e's A is rows ``e*r .. e*r+r-1`` of lora_A, its B the columns
``j*E + e`` (j < r) of lora_B. So ``peft`` (``PeftModel.from_pretrained`` on the Hugging Face model)
loads what :func:`save_lora` writes and :func:`load_lora` reads what PEFT saves.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .lora import ATTENTION_PROJS, MLP_PROJS, LoRAError, apply_lora, lora_modules

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def hf_module_name(name: str) -> str:
    """Model-relative module name -> Hugging Face's (``layers.3.attention.q_proj`` ->
    ``model.layers.3.self_attn.q_proj``; ``layers.1.ffn.experts`` -> ``model.layers.1.mlp.experts``)."""
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 3:
        raise LoRAError(f"no Hugging Face name for module {name!r}")
    sub = {"attention": "self_attn", "ffn": "mlp"}.get(parts[2])
    if sub is None:
        raise LoRAError(f"no Hugging Face name for module {name!r}")
    return ".".join(["model", "layers", parts[1], sub] + parts[3:])


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as PEFT's safetensors keys -> tensors (full tensors, gathered under FSDP; an
    expert-parallel model's adapters come through ``trainer.publish.iter_lora_weights`` instead)."""
    return peft_state(model, {n: _full(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith(
        "lora_")})


def peft_state(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's safetensors keys -> tensors, from the adapters' full tensors by model name
    (``layers.0.attention.q_proj.lora_A``, ``layers.1.ffn.experts.lora_B13``, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        hf = _PREFIX + hf_module_name(name)
        if hasattr(m, "w13"):
            for key, an, bn in (("base_layer.", "lora_A13", "lora_B13"), ("", "lora_A2", "lora_B2")):
                a, b = params[f"{name}.{an}"], params[f"{name}.{bn}"]
                E, r = a.shape[:2]
                out[f"{hf}.{key}lora_A.weight"] = a.reshape(E * r, a.shape[2]).contiguous()
                # B_e's column j lands at column j*E + e: [E, n, r] -> [n, r, E] -> [n, r*E]
                out[f"{hf}.{key}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous()
        else:
            out[f"{hf}.lora_A.weight"] = params[f"{name}.lora_A"].contiguous()
            out[f"{hf}.lora_B.weight"] = params[f"{name}.lora_B"].contiguous()
    return out


def write_peft_dir(model: nn.Module, path, tensors: dict[str, torch.Tensor], *,
                   base_model_name_or_path: str | None = None) -> int:
    """Write ``tensors`` (PEFT keys, :func:`peft_state`) and ``model``'s adapter config into the
    directory ``path``; -> the bytes of the tensors written."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(adapter_config(model, base_model_name_or_path), f, indent=2, sort_keys=True)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_config(model: nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for ``model``'s adapters."""
    spec = model.lora
    modules, params = set(), set()
    for name in spec.modules:
        parts = name.split(".")
        if parts[-1] == "experts":
            params.update(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        elif parts[2] == "attention":
            modules.add(parts[-1])
        else:  # "mlp.gate_proj" / "shared_experts.gate_proj": PEFT matches names by their ending
            modules.add(("mlp." if len(parts) == 4 else "shared_experts.") + parts[-1])
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "target_modules": sorted(modules), "target_parameters": sorted(params) or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def save_lora(model: nn.Module, path, *, base_model_name_or_path: str | None = None) -> None:
    """Write ``model``'s adapters to directory ``path`` in PEFT's format (a collective under FSDP:
    every rank calls it, global rank 0 writes). ``base_model_name_or_path`` names the base in the config."""
    tensors = adapter_tensors(model)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    write_peft_dir(model, path, tensors, base_model_name_or_path=base_model_name_or_path)


def read_adapter_config(path) -> dict:
    cfg_path = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"load_lora: {cfg_path} does not exist (a PEFT adapter directory has {CONFIG_NAME} and "
                        f"{WEIGHTS_NAME})")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"load_lora: {cfg_path}: peft_type is {cfg.get('peft_type')!r}, not 'LORA'")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"load_lora: {cfg_path}: {key} {cfg[key]} is not supported (one rank and alpha for all)")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(key):
            raise LoRAError(f"load_lora: {cfg_path}: {key}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"load_lora: {cfg_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    return cfg


def _targets_of(cfg: dict) -> tuple[str, ...]:
    mods = cfg.get("target_modules") or []
    if isinstance(mods, str):
        raise LoRAError(f"load_lora: target_modules as a pattern ({mods!r}) is not supported; list module names")
    out = []
    for m in mods:
        leaf = m.rsplit(".", 1)[-1]
        if leaf in ATTENTION_PROJS:
            out.append(leaf)
        elif leaf in MLP_PROJS and m.split(".")[-2:-1] in (["mlp"], ["shared_experts"]):
            out.append(m.split(".")[-2])
        else:
            raise LoRAError(f"load_lora: target_modules entry {m!r} names no module LoRA can adapt here "
                            f"(attention projections, mlp.<proj>, shared_experts.<proj>)")
    if any(p.endswith("gate_up_proj") or p.endswith("down_proj") for p in cfg.get("target_parameters") or []):
        out.append("experts")
    return tuple(dict.fromkeys(out))


def load_lora(model: nn.Module, path) -> nn.Module:
    """Read a PEFT LoRA adapter directory into ``model`` (applying LoRA with the adapter's rank,
    alpha and targets first if the model has none); every tensor's name and shape is checked before
    anything is copied: an unknown, missing or misshapen tensor raises :class:`LoRAError` naming it."""
    from .checkpoint import read_safetensors

    path = os.fspath(path)
    cfg = read_adapter_config(path)
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise LoRAError(f"load_lora: {weights} does not exist")
    if getattr(model, "lora", None) is None:
        apply_lora(model, int(cfg["r"]), float(cfg.get("lora_alpha", 8)), targets=_targets_of(cfg),
                   dropout=float(cfg.get("lora_dropout") or 0.0))
    spec = model.lora
    if int(cfg["r"]) != spec.rank or float(cfg.get("lora_alpha", 8)) != spec.alpha:
        raise LoRAError(f"load_lora: {path} has r={cfg['r']}, lora_alpha={cfg.get('lora_alpha')}; the model's adapters "
                        f"have rank={spec.rank}, alpha={spec.alpha}")
    load_adapter_tensors(model, read_safetensors(weights), os.path.basename(weights))
    return model


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], where: str = "the adapter") -> None:
    """Copy PEFT-keyed adapter ``tensors`` into ``model``'s adapters after checking every name and
    shape (``where`` names the source in the errors)."""
    tensors = {(k if k.startswith(_PREFIX) else _PREFIX + k): v for k, v in tensors.items()}
    expected = {k: tuple(v.shape) for k, v in adapter_tensors_meta(model).items()}
    for k, v in tensors.items():
        if k not in expected:
            raise LoRAError(f"load_lora: {where} has tensor {k!r}, which no adapter of this model "
                            "has (targets differ or the base is another model)")
        if tuple(v.shape) != expected[k]:
            raise LoRAError(f"load_lora: tensor {k!r} has shape {tuple(v.shape)}, this model's adapter expects "
                            f"{expected[k]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise LoRAError(f"load_lora: {where} lacks {len(missing)} adapter tensor(s) of this model, "
                        f"e.g. {missing[0]!r}")
    _copy_in(model, tensors)


def adapter_tensors_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`adapter_tensors` shapes without gathering (meta tensors of the global shapes)."""
    out = {}
    for name, m in lora_modules(model).items():
        hf = _PREFIX + hf_module_name(name)
        if hasattr(m, "w13"):
            E, r, D = m.lora_A13.shape
            two_i, inter = m.lora_B13.shape[1], m.lora_A2.shape[2]
            out[f"{hf}.base_layer.lora_A.weight"] = torch.empty(E * r, D, device="meta")
            out[f"{hf}.base_layer.lora_B.weight"] = torch.empty(two_i, r * E, device="meta")
            out[f"{hf}.lora_A.weight"] = torch.empty(E * r, inter, device="meta")
            out[f"{hf}.lora_B.weight"] = torch.empty(m.lora_B2.shape[1], r * E, device="meta")
        else:
            out[f"{hf}.lora_A.weight"] = torch.empty(m.lora_A.shape, device="meta")
            out[f"{hf}.lora_B.weight"] = torch.empty(m.lora_B.shape, device="meta")
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if hasattr(dst, "full_tensor"):  # a DTensor: distribute the full value with dst's placements
        from torch.distributed.tensor import distribute_tensor

        src = distribute_tensor(src.to(dst.dtype), dst.device_mesh, dst.placements)
    dst.copy_(src)


@torch.no_grad()
def _copy_in(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, m in lora_modules(model).items():
        hf = _PREFIX + hf_module_name(name)
        if hasattr(m, "w13"):
            E, r = m.lora_A13.shape[:2]
            for key, a, b in (("base_layer.", m.lora_A13, m.lora_B13), ("", m.lora_A2, m.lora_B2)):
                ta, tb = tensors[f"{hf}.{key}lora_A.weight"], tensors[f"{hf}.{key}lora_B.weight"]
                _copy(a, ta.reshape(E, r, ta.shape[1]))
                _copy(b, tb.reshape(tb.shape[0], r, E).permute(2, 0, 1))
        else:
            _copy(m.lora_A, tensors[f"{hf}.lora_A.weight"])
            _copy(m.lora_B, tensors[f"{hf}.lora_B.weight"])
