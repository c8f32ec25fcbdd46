"""Sidecar settings: ``WARMROUTE_VISION_*`` environment variables, overridden by the command line."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Dtype = Literal["auto", "bfloat16", "float16", "float32"]

MIB = 1024 * 1024


class VisionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WARMROUTE_VISION_", extra="forbid")

    checkpoint: Path
    host: str = "127.0.0.1"
    port: int = Field(default=8490, ge=0, le=65535)

    # torch intra-op threads for the encoder; one image is encoded at a time (requests queue behind it).
    threads: int = Field(default=2, ge=1)
    # "auto": the checkpoint's own torch_dtype, which is what the engine's text model expects.
    dtype: Dtype = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # torch.compile each vision block (fuses the elementwise work around the matmuls: rotary, GELU, norms).
    # Off by default: outputs then differ from transformers' in the last bf16 bit, and the first image of
    # each new size pays the compile.
    compile: bool = False
    # Images larger than this are downscaled (aspect kept, to the patch grid) by the image processor, the
    # same smart_resize the engine would apply with this max_pixels; never refused for it.
    max_pixels: int = Field(default=1_120_000, ge=1)
    min_pixels: int | None = Field(default=None, ge=1)
    # Decompression-bomb guard: refused (413) from the header's size, before any pixel is decoded.
    max_source_pixels: int = Field(default=40_000_000, ge=1)

    queue_size: int = Field(default=8, ge=0)  # encodes allowed to wait behind the running one; then 503
    cache_bytes: int = Field(default=512 * MIB, ge=0)

    max_download_bytes: int = Field(default=20 * MIB, ge=1)
    fetch_timeout_s: float = Field(default=10.0, gt=0)  # the whole fetch: DNS, connect, redirects, body
    connect_timeout_s: float = Field(default=3.0, gt=0)
    max_redirects: int = Field(default=3, ge=0)
    # Networks an operator trusts despite the address policy (e.g. an internal image store): CIDRs.
    allow_networks: list[str] = Field(default_factory=list)

    @field_validator("allow_networks")
    @classmethod
    def _networks_parse(cls, value: list[str]) -> list[str]:
        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value
