"""The loader reads only the vision tower, and the sidecar's embeddings are transformers' own, bit for bit."""

from __future__ import annotations

import base64
import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from vision_images import png_bytes  # noqa: E402

from sidecars.vision import loader  # noqa: E402
from sidecars.vision.encoder import Encoder  # noqa: E402
from sidecars.vision.errors import CheckpointError  # noqa: E402
from sidecars.vision.settings import VisionSettings  # noqa: E402


def decoded(payload: bytes) -> torch.Tensor:
    tensor: torch.Tensor = torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True)
    return tensor


def vision_shards(folder: Path) -> set[str]:
    index = json.loads((folder / loader.INDEX).read_text())["weight_map"]
    return {shard for key, shard in index.items() if key.startswith("visual.")}


@pytest.mark.parametrize(("width", "height"), [(230, 150), (64, 400), (448, 336)])
def test_embeddings_equal_transformers_get_image_features_bit_for_bit(
    encoder: Any, tiny_checkpoint: Path, width: int, height: int
) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    image = Image.open(io.BytesIO(png_bytes(width, height, seed=width))).convert("RGB")
    encoded, _timings = encoder.encode(image)

    full = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_checkpoint), dtype=torch.bfloat16)
    batch = encoder.processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        (reference,) = full.model.get_image_features(
            batch["pixel_values"], batch["image_grid_thw"]
        ).pooler_output
    embeds, grid = decoded(encoded.image_embeds), decoded(encoded.image_grid_thw)
    assert embeds.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(embeds, reference)
    assert grid.shape == (3,) and grid.tolist() == batch["image_grid_thw"][0].tolist()
    assert encoded.tokens == embeds.shape[0] == int(grid.prod()) // 4 and encoded.hidden == 256


def test_qwen3_5_tower_is_supported_bit_for_bit(tiny_qwen3_5_checkpoint: Path) -> None:
    from transformers import Qwen3_5ForConditionalGeneration

    encoder = Encoder(VisionSettings(checkpoint=tiny_qwen3_5_checkpoint))
    image = Image.open(io.BytesIO(png_bytes(300, 200, seed=5))).convert("RGB")
    encoded, _timings = encoder.encode(image)
    full = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_qwen3_5_checkpoint), dtype=torch.bfloat16)
    batch = encoder.processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        (reference,) = full.model.get_image_features(
            batch["pixel_values"], batch["image_grid_thw"]
        ).pooler_output
    assert torch.equal(decoded(encoded.image_embeds), reference)
    assert encoded.grid_thw == (1, 12, 18) and encoded.tokens == 54 and encoded.hidden == 128
    report = encoder.report
    assert (report.architecture, report.tower_class, report.prefix) == (
        "qwen3_5",
        "Qwen3_5VisionModel",
        "model.visual.",
    )
    assert len(report.shards_read) < report.shards_total


def test_loader_opens_only_the_vision_shards_and_reports_bytes(tiny_checkpoint: Path) -> None:
    opened: list[str] = []

    def recording_open(path: str, **kwargs: Any) -> Any:
        opened.append(Path(path).name)
        return safe_open(path, **kwargs)

    encoder = Encoder(VisionSettings(checkpoint=tiny_checkpoint), opener=recording_open)
    all_shards = set(json.loads((tiny_checkpoint / loader.INDEX).read_text())["weight_map"].values())
    report = encoder.report
    assert sorted(opened) == sorted(vision_shards(tiny_checkpoint)) == sorted(report.shards_read)
    assert len(opened) == 3 < len(all_shards) == report.shards_total == 14  # the text model's 11 never opened
    assert report.prefix == "visual." and report.architecture == "qwen2_5_vl"
    headers = sum(8 + struct.unpack("<Q", (tiny_checkpoint / s).read_bytes()[:8])[0] for s in opened)
    tensor_bytes = sum(p.numel() * p.element_size() for p in encoder.model.state_dict().values())
    assert report.bytes_read == headers + tensor_bytes
    assert report.checkpoint_bytes == sum((tiny_checkpoint / s).stat().st_size for s in all_shards)
    assert report.bytes_read < report.checkpoint_bytes / 5


def test_the_prefix_is_found_from_the_index_whatever_it_is(copy_checkpoint: Path) -> None:
    """A single-file checkpoint whose tower lives under ``model.visual.`` (newer Qwen builds)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in vision_shards(copy_checkpoint):
        with safe_open(str(copy_checkpoint / shard), framework="pt") as handle:
            tensors |= {f"model.{k}": handle.get_tensor(k) for k in handle.keys() if k.startswith("visual.")}  # noqa: SIM118
        (copy_checkpoint / shard).unlink()
    (copy_checkpoint / loader.INDEX).unlink()
    save_file(tensors, str(copy_checkpoint / loader.SINGLE))
    encoder = Encoder(VisionSettings(checkpoint=copy_checkpoint))
    assert encoder.report.prefix == "model.visual." and encoder.report.shards_read == (loader.SINGLE,)


def edit_index(folder: Path, edit: Any) -> None:
    path = folder / loader.INDEX
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_a_missing_vision_shard_is_named(copy_checkpoint: Path) -> None:
    (copy_checkpoint / "model-00013-of-00014.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"shard model-00013-of-00014\.safetensors \(holds visual\.\* tensors\)"
    ):
        loader.plan(copy_checkpoint)


def test_a_missing_text_shard_does_not_matter(copy_checkpoint: Path) -> None:
    (copy_checkpoint / "model-00003-of-00014.safetensors").unlink()
    assert Encoder(VisionSettings(checkpoint=copy_checkpoint)).report.tensors == 30


def test_a_missing_key_is_named(copy_checkpoint: Path) -> None:
    edit_index(copy_checkpoint, lambda m: m.pop("visual.blocks.1.attn.qkv.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing key visual\.blocks\.1\.attn\.qkv\.weight \(1 missing\)"
    ):
        Encoder(VisionSettings(checkpoint=copy_checkpoint))


def test_an_unsupported_architecture_is_named(copy_checkpoint: Path) -> None:
    config = json.loads((copy_checkpoint / "config.json").read_text())
    (copy_checkpoint / "config.json").write_text(json.dumps(config | {"model_type": "llava"}))
    with pytest.raises(
        CheckpointError, match=r"unsupported architecture model_type='llava'.*supported: qwen2_5_vl"
    ):
        loader.plan(copy_checkpoint)


@pytest.mark.parametrize("name", ["config.json", "preprocessor_config.json", loader.INDEX])
def test_a_missing_file_is_named(copy_checkpoint: Path, name: str) -> None:
    (copy_checkpoint / name).unlink()
    expected = "neither model.safetensors.index.json nor model.safetensors" if name == loader.INDEX else name
    with pytest.raises(CheckpointError, match=f"{expected}.* found in|{expected} not found in"):
        Encoder(VisionSettings(checkpoint=copy_checkpoint))


def test_dtype_setting_overrides_the_checkpoint(tiny_checkpoint: Path) -> None:
    encoder = Encoder(VisionSettings(checkpoint=tiny_checkpoint, dtype="float32"))
    encoded, _ = encoder.encode(Image.open(io.BytesIO(png_bytes(56, 56))).convert("RGB"))
    assert encoded.dtype == "float32" and decoded(encoded.image_embeds).dtype == torch.float32
