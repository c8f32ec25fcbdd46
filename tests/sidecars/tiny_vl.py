"""A tiny random-weight Qwen2.5-VL checkpoint, made at test time (nothing can be downloaded here).

Sizes the real engines were seen to serve on the CPU (text hidden 256; vision depth 2, hidden 64,
out_hidden 256, patch 14, merge 2), saved
in small shards so the ``model.visual.*`` tensors sit on shards of their own, after the text model's, and
``model.safetensors.index.json`` exists. bfloat16, as the engines serve it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 1234
SHARD = "300KB"


def vl_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    text = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 1,
        "out_hidden_size": 256,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,  # 2x2 merged patches per window: small images still have several windows
        "fullatt_block_indexes": [1],  # block 0 windowed, block 1 full: both attention paths run
    }
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001
    )
    config.dtype = "bfloat16"
    return config


def build(folder: Path) -> Path:
    """Write the checkpoint into ``folder`` (idempotent: a finished folder is reused)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    done = folder / "DONE"
    if done.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(vl_config()).to(torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size=SHARD)
    Qwen2VLImageProcessorPil(max_pixels=1_003_520, min_pixels=3136).save_pretrained(str(folder))
    done.write_text(json.dumps({"seed": SEED}))
    return folder


def qwen3_5_config() -> Any:
    """Qwen3.5 (its tower: learned + rotary positions, full attention, LayerNorm), as tiny as it goes."""
    from transformers import Qwen3_5Config

    text = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "vocab_size": 1024,
        "layer_types": ["linear_attention", "full_attention"],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 1,
        "out_hidden_size": 128,
        "num_position_embeddings": 64,
    }
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001)
    config.dtype = "bfloat16"
    return config


def build_qwen3_5(folder: Path) -> Path:
    import torch
    from transformers import Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

    if (folder / "DONE").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = Qwen3_5ForConditionalGeneration(qwen3_5_config()).to(torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size=SHARD)
    Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(str(folder))
    (folder / "DONE").write_text(json.dumps({"seed": SEED}))
    return folder
