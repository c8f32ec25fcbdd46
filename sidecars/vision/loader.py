"""Load only the vision tower of a local multimodal checkpoint.

``model.safetensors.index.json`` says which shard holds each tensor. The tower's prefix (``model.visual.`` in
current Qwen builds, ``visual.`` in older ones) is found from the index itself: the key that ends in the
patch embedding's weight. Only the shards holding tensors under that prefix are opened, and only those
tensors are read. The model class comes from an explicit table keyed by the checkpoint's ``model_type``.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ANCHOR = "patch_embed.proj.weight"  # every supported tower has it; its key reveals the prefix


@dataclass(frozen=True, slots=True)
class Architecture:
    module: str  # transformers module holding the tower class
    tower: str


# model_type → the vision tower transformers builds inside that model (``self.visual``).
ARCHITECTURES: dict[str, Architecture] = {
    "qwen2_vl": Architecture(
        "transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"
    ),
    "qwen2_5_vl": Architecture(
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"
    ),
    "qwen3_5": Architecture("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"),
    "qwen3_5_moe": Architecture(
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"
    ),
}


@dataclass(frozen=True, slots=True)
class LoadReport:
    architecture: str  # model_type
    tower_class: str
    prefix: str
    dtype: str
    shards_read: tuple[str, ...]
    shards_total: int
    bytes_read: int  # safetensors headers + the tower's tensors
    checkpoint_bytes: int  # all weight files the index names (those present on disk)
    tensors: int
    ignored_keys: tuple[
        str, ...
    ] = ()  # under the prefix but not in this transformers' tower (e.g. deepstack)


@dataclass
class Plan:
    """What will be read, decided from the JSON files alone (cheap; run before the server starts)."""

    folder: Path
    config: Any  # the full model's transformers config
    architecture: str
    prefix: str
    by_shard: dict[str, list[str]] = field(default_factory=dict)  # shard file → full tensor names
    checkpoint_bytes: int = 0


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path.name} not found in {path.parent}")
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    return loaded


def weight_map(folder: Path) -> dict[str, str]:
    if (folder / INDEX).is_file():
        mapping: dict[str, str] = read_json(folder / INDEX).get("weight_map", {})
        if not mapping:
            raise CheckpointError(f"{folder / INDEX} has no weight_map")
        return mapping
    single = folder / SINGLE
    if not single.is_file():
        raise CheckpointError(f"neither {INDEX} nor {SINGLE} found in {folder}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), SINGLE)


def find_prefix(mapping: dict[str, str], folder: Path) -> str:
    prefixes = sorted({k[: -len(ANCHOR)] for k in mapping if k.endswith(ANCHOR)})
    towers = [p for p in prefixes if "visual" in p or "vision" in p] or prefixes
    if len(towers) != 1:
        found = ", ".join(prefixes) or "none"
        raise CheckpointError(f"cannot find one vision tower in {folder}: keys ending in {ANCHOR!r}: {found}")
    return towers[0]


def plan(folder: Path) -> Plan:
    from transformers import AutoConfig

    model_type = read_json(folder / "config.json").get("model_type", "")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise CheckpointError(
            f"unsupported architecture model_type={model_type!r} in {folder}; supported: {supported}"
        )
    config = AutoConfig.from_pretrained(str(folder))
    mapping = weight_map(folder)
    prefix = find_prefix(mapping, folder)
    result = Plan(folder, config, model_type, prefix)
    for key, shard in sorted(mapping.items()):
        if key.startswith(prefix):
            result.by_shard.setdefault(shard, []).append(key)
    for shard in result.by_shard:
        if not (folder / shard).is_file():
            raise CheckpointError(f"shard {shard} (holds {prefix}* tensors) not found in {folder}")
    result.checkpoint_bytes = sum(
        os.path.getsize(folder / s) for s in set(mapping.values()) if (folder / s).is_file()
    )
    return result


def tower_class(architecture: str) -> type[torch.nn.Module]:
    arch = ARCHITECTURES[architecture]
    try:
        found: type[torch.nn.Module] = getattr(importlib.import_module(arch.module), arch.tower)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"this transformers does not ship {arch.module}.{arch.tower}: {exc}") from exc
    return found


def resolve_dtype(config: Any, requested: str) -> torch.dtype:
    name = requested
    if requested == "auto":
        declared = getattr(config, "dtype", None) or getattr(config.vision_config, "dtype", None)
        name = str(declared or "float32").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint's config")
    return dtype


def header_bytes(path: Path) -> int:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
    return 8 + int(length)


Opener = Callable[..., Any]
open_safetensors: Opener = safe_open


def read_tensors(
    p: Plan, dtype: torch.dtype, opener: Opener = safe_open
) -> tuple[dict[str, torch.Tensor], int]:
    """The tower's tensors (names without the prefix) and the bytes read for them."""
    tensors: dict[str, torch.Tensor] = {}
    read = 0
    for shard, keys in p.by_shard.items():
        read += header_bytes(p.folder / shard)
        with opener(str(p.folder / shard), framework="pt") as handle:
            for key in keys:
                tensor = handle.get_tensor(key)
                read += tensor.numel() * tensor.element_size()
                tensors[key[len(p.prefix) :]] = tensor.to(dtype)
    return tensors, read


def build(
    p: Plan, dtype: torch.dtype, attn_implementation: str, opener: Opener = safe_open
) -> tuple[torch.nn.Module, LoadReport]:
    from transformers.initialization import no_init_weights

    cls = tower_class(p.architecture)
    vision_config = p.config.vision_config
    vision_config._attn_implementation = attn_implementation
    with no_init_weights():  # every parameter is overwritten below; random init would cost seconds
        model = cls._from_config(vision_config, dtype=dtype)  # type: ignore[attr-defined]
    tensors, read = read_tensors(p, dtype, opener)
    expected = set(model.state_dict())
    missing = sorted(expected - tensors.keys())
    if missing:
        shards = ", ".join(p.by_shard)
        raise CheckpointError(
            f"missing key {p.prefix}{missing[0]} ({len(missing)} missing) in {shards} of {p.folder}"
        )
    ignored = tuple(sorted(tensors.keys() - expected))
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=True)
    model.eval().requires_grad_(False)
    report = LoadReport(
        architecture=p.architecture,
        tower_class=cls.__name__,
        prefix=p.prefix,
        dtype=str(dtype).removeprefix("torch."),
        shards_read=tuple(p.by_shard),
        shards_total=len(set(weight_map(p.folder).values())),
        bytes_read=read,
        checkpoint_bytes=p.checkpoint_bytes,
        tensors=len(expected),
        ignored_keys=tuple(p.prefix + k for k in ignored),
    )
    return model, report
