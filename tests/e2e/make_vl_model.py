"""Generate a tiny random-weight Qwen2.5-VL that real vLLM serves on the CPU, with a tokenizer, processor and
chat template, for tests/e2e/test_vision*.py. Run it with the VL venv's interpreter (venv_vl.sh):

    ~/.cache/warmroute/e2e-vl-venv/bin/python tests/e2e/make_vl_model.py   # cached; prints the model dir

Sizes the CPU engines accept: text hidden 256 (4 heads of 64: the CPU attention refuses head_dim 16),
2 layers; vision depth 2, hidden 64, out_hidden 256, patch 14, merge 2. The weights are re-sharded so the
vision tensors (``visual.*``) sit on the *last* shard (transformers writes them first), with
``model.safetensors.index.json``: the sidecar must find them from the index, not from their position.
Deterministic; the cache directory is named after a hash of this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # make_model.py: the corpus the BPE tokenizer learns from

import make_model  # noqa: E402

NAME = "tiny-vl"
SEED = 1234
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: transformers 5 writes the original checkpoint layout (``visual.*``; ``model.visual.*`` in its own modules)
VISION_PREFIXES = ("visual.", "model.visual.")
TEXT_SHARDS = 2  # the text model's tensors over two shards, the vision tower's on a third

# ChatML with Qwen2-VL's image placeholder; vLLM sees a loop over content parts ("openai" content format) and
# hands image parts (image_url and image_embeds alike) to the template as {"type": "image"}.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}"
    "{%- elif part.type in ['image', 'image_url', 'image_embeds'] %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes() + Path(make_model.__file__).read_bytes()).hexdigest()[
        :12
    ]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_model.corpus(make_model.ModelSpec(corpus_sentences=10_000)), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=8192,
        chat_template=CHAT_TEMPLATE,
    )


def config(tok: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = {
        "vocab_size": len(tok),
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
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
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=None,
    )
    cfg.dtype = "bfloat16"
    return cfg


def reshard(folder: Path) -> dict[str, Any]:
    """Rewrite the weights: text tensors on the first shards, the vision tower's on the last."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    text = sorted(k for k in tensors if not k.startswith(VISION_PREFIXES))
    visual = sorted(k for k in tensors if k.startswith(VISION_PREFIXES))
    if not visual:
        raise SystemExit(
            f"make_vl_model: no vision tensors ({VISION_PREFIXES}) among {sorted(tensors)[:5]}..."
        )
    per = -(-len(text) // TEXT_SHARDS)
    groups = [text[i : i + per] for i in range(0, len(text), per)] + [visual]
    weight_map: dict[str, str] = {}
    for n, keys in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return index


def write(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
    )

    tok = tokenizer()
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config(tok)).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>")]
    model.save_pretrained(str(out))
    reshard(out)
    image = Qwen2VLImageProcessorPil(max_pixels=1_003_520, min_pixels=3136)
    processor = Qwen2_5_VLProcessor(
        image_processor=image,
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    image.save_pretrained(str(out))  # preprocessor_config.json too, as published checkpoints have it
    tok.save_pretrained(str(out))


def main() -> int:
    root = Path(os.environ.get("WARMROUTE_E2E_CACHE", Path.home() / ".cache" / "warmroute")) / "models"
    out = root / f"{NAME}-{digest()}"
    if not (out / "DONE").is_file():
        started = time.monotonic()
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            (tmp / "DONE").write_text(json.dumps({"seed": SEED}))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"make_vl_model: wrote {out} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
