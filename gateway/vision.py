"""Images by backend ``vision`` mode: where an image request may go, and what it looks like when it arrives.

- ``VisionRouting`` (a ``RouteFilter``, before routing): a request with image parts never goes to a
  ``vision: none`` backend; if every backend of the model is ``none`` it is a 400. While the sidecar is not
  available, ``embeds`` backends are left out too when a ``native`` backend serves the model (otherwise the
  ``embeds`` attempt answers the sidecar's 503). Text-only requests are not looked at twice.
- ``VisionStep`` (a ``PrepareStep``, per attempt): for an ``embeds`` backend each ``image_url`` part becomes
  ``{"type": "image_embeds", "image_embeds": {"image_embeds": b64, "image_grid_thw": b64}}`` through the
  sidecar: the unique images of the request encoded in parallel, each once per request (retries included).
  ``native`` backends get the parts as the client sent them, and a request without images is never touched,
  so its bytes go upstream as the client sent them.

Messages ``image`` blocks and Responses ``input_image`` parts are found by their shape (``ApiShape.images``);
neither shape's native vLLM route takes image embeddings, so such a request on an ``embeds`` backend is
translated to chat for that attempt (``as_chat``, gateway/translation.py) and its chat ``image_url`` parts
are replaced like a chat request's; a sidecar refusal still names the client's own field.

The conversation key was computed by the endpoint on the original body (routing/keys.py hashes a ``data:``
image by content, a URL by the URL), so turn N with the same images keys like turn 1 whichever way each
attempt is shaped. The ``detail`` of an ``image_url`` is not forwarded to ``embeds`` backends: the sidecar's
own pixel cap decides the resolution.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from backends.dialects import DIALECTS, EmbedsFormat
from backends.registry import Backend, Registry
from config.settings import BackendConfig, VisionMode
from gateway.context import Draft, RequestContext
from gateway.errors import BadRequest, GatewayError, UpstreamError
from gateway.images import ImagePart, VisionMemo, content_parts
from gateway.inbound import check_text
from gateway.sidecar import Encoding, ImageRejected, SidecarClient, SidecarHost, VisionUnavailable

EMPTY: frozenset[str] = frozenset()


def find_images(body: dict[str, Any] | None) -> tuple[ImagePart, ...]:
    """The ``image_url`` parts of a chat body, in order. A part without a string URL is a 400."""
    if body is None:
        return ()
    return tuple(
        ImagePart(i, j, _url_of(part.get("image_url"), i, j))
        for i, j, part in content_parts(body.get("messages"))
        if part.get("type") == "image_url"
    )


def _url_of(image_url: Any, i: int, j: int) -> str:
    """The part's URL. A lone surrogate in it is a 400 here, in any turn: the endpoint checks only the
    conversation head, and the sidecar's request cannot carry one (its JSON is UTF-8)."""
    where = f"messages[{i}].content[{j}].image_url"
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise BadRequest(f"'{where}' must be an object with a non-empty string 'url'", param=where)
    check_text(url, where + ".url" if isinstance(image_url, dict) else where)
    return url


def memo_of(ctx: RequestContext) -> VisionMemo:
    if ctx.vision is None:
        found = ctx.shape.images  # the shape's own image parts (Anthropic's ``image`` blocks)
        images = find_images(ctx.body) if found is None or ctx.body is None else found(ctx.body)
        ctx.vision = VisionMemo(tuple(images))
    return ctx.vision


class VisionRouting:
    """The ``RouteFilter``: which backends must not be chosen for this request (see the module's notes)."""

    def __init__(self, registry: Registry, host: SidecarHost | None) -> None:
        self.registry = registry
        self.host = host

    def ineligible(self, ctx: RequestContext) -> frozenset[str]:
        if ctx.body is None or not ctx.shape.vision or not memo_of(ctx).images:
            return EMPTY
        backends = self.registry.for_model(ctx.model)
        by_mode: dict[VisionMode, set[str]] = {mode: set() for mode in VisionMode}
        for b in backends:
            by_mode[b.cfg.vision].add(b.id)
        if not by_mode[VisionMode.NATIVE] and not by_mode[VisionMode.EMBEDS]:
            ids = ", ".join(sorted(by_mode[VisionMode.NONE]))
            raise BadRequest(
                f"model {ctx.model!r} takes no images here: its backends ({ids}) are text-only "
                "(vision: none)",
                param="messages",
            )
        out = by_mode[VisionMode.NONE]
        if not ctx.shape.embeds and not ctx.shape.embeds_via_chat:
            # Its native route takes no image embeddings, and it has no translation to chat that would.
            if not by_mode[VisionMode.NATIVE]:
                ids = ", ".join(sorted(by_mode[VisionMode.EMBEDS]))
                raise BadRequest(
                    f"model {ctx.model!r} takes images on {ctx.shape.path} only from vision: native "
                    f"backends; its image backends ({ids}) take image embeddings, which this route "
                    "cannot carry; send the images to /v1/chat/completions",
                    param="messages",
                )
            return frozenset(out | by_mode[VisionMode.EMBEDS])
        sidecar_down = self.host is None or not self.host.available
        if sidecar_down and by_mode[VisionMode.NATIVE]:
            out = out | by_mode[VisionMode.EMBEDS]
        return frozenset(out)


class VisionStep:
    """The ``PrepareStep``: ``image_url`` parts to ``image_embeds`` parts for ``embeds`` backends."""

    def __init__(self, sidecar: SidecarClient | None) -> None:
        self.sidecar = sidecar

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        if backend.cfg.vision is not VisionMode.EMBEDS or not ctx.shape.vision:
            return
        translated = ctx.attempt is not None and ctx.attempt.translated is not None
        if not ctx.shape.embeds and not translated:
            return  # (its images reach an embeds backend only as chat: ``VisionRouting``, ``as_chat``)
        memo = memo_of(ctx)
        if not memo.images:
            return
        fmt = DIALECTS[backend.cfg.dialect].embeds
        if fmt is None:  # refused at start-up and by the admin API (``no_embeds``): belt and braces
            raise UpstreamError(
                f"backend {backend.id}: dialect {backend.cfg.dialect} takes no image embeddings"
            )
        await self._encode(memo)  # the client's parts: a refusal names the client's field
        shaped = draft.edit()
        # A translated draft is chat: its image parts are found where the translation put them (the same
        # URLs, a base64 source as its data: URL), so the client shape's encodings serve it.
        at = find_images(shaped) if translated else memo.images
        shaped["messages"] = _with_embeds(shaped["messages"], at, memo.encodings, fmt)

    async def _encode(self, memo: VisionMemo) -> None:
        """Encode the request's images not encoded yet, in parallel, each unique image once."""
        if self.sidecar is None:  # settings refuse embeds backends without a sidecar; belt and braces
            raise VisionUnavailable("no vision sidecar is configured for embeds backends")
        sidecar = self.sidecar
        first: dict[str, ImagePart] = {}
        for image in memo.images:
            if image.url not in memo.encodings:
                first.setdefault(image.url, image)
        if not first:
            return
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {url: group.create_task(_encode_one(sidecar, part)) for url, part in first.items()}
        except* GatewayError as failed:
            raise failed.exceptions[0] from None  # the first refusal answers; the others were cancelled
        for url, task in tasks.items():
            memo.encodings[url] = task.result()


def as_chat(ctx: RequestContext, backend: Backend) -> bool:
    """This attempt must go as chat: its shape's native route takes no image embeddings, the request holds
    images and the backend is ``vision: embeds`` (gateway/translation.py translates it)."""
    if backend.cfg.vision is not VisionMode.EMBEDS or not ctx.shape.embeds_via_chat or ctx.body is None:
        return False
    return bool(memo_of(ctx).images)


def no_embeds(cfg: BackendConfig) -> str | None:
    """Why ``cfg`` cannot be ``vision: embeds`` (its engine takes no ``image_embeds`` parts), or None."""
    if cfg.vision is not VisionMode.EMBEDS or DIALECTS[cfg.dialect].embeds is not None:
        return None
    return f"backend {cfg.id}: dialect {cfg.dialect} takes no image embeddings; use vision: native or none"


async def _encode_one(sidecar: SidecarClient, image: ImagePart) -> Encoding:
    try:
        return await sidecar.encode(image.url)
    except ImageRejected as exc:
        exc.param = image.param  # which part of the request the client must fix
        if image.at is not None:  # another shape's part: Anthropic's error object has no param to carry it
            exc.message = f"{image.param}: {exc.message}"
        raise


def _with_embeds(
    messages: list[Any], images: tuple[ImagePart, ...], encodings: dict[str, Encoding], fmt: EmbedsFormat
) -> list[Any]:
    """A new messages list: the messages holding images rebuilt, the others shared with the original."""
    out = list(messages)
    for index in _distinct(image.message for image in images):
        msg = messages[index]
        content = [_embeds_part(encodings, part, fmt) for part in msg["content"]]
        out[index] = {**msg, "content": content}
    return out


def _embeds_part(encodings: dict[str, Encoding], part: Any, fmt: EmbedsFormat) -> Any:
    if not (isinstance(part, dict) and part.get("type") == "image_url"):
        return part
    image_url = part["image_url"]
    enc = encodings[image_url["url"] if isinstance(image_url, dict) else image_url]
    return fmt.part(enc.image_embeds, enc.image_grid_thw)


def _distinct(values: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(values))
