"""Where a prompt's images go, TRL's rule (trl.data_utils.prepare_multimodal_messages): a conversational prompt
whose messages have no image parts gets one `{"type": "image"}` part per image before the text of its first user
message; image parts without an image are filled with the row's images in order; the count of empty parts must
equal the count of images. A part may carry its own image instead (`"image"`: a PIL image, path or bytes;
`"path"` or `"url"`). A plain string prompt with images becomes one user message (TRL refuses it)."""

from __future__ import annotations

from typing import Any

from grpokit.vision.images import load_image

OWN_IMAGE_KEYS = ("image", "path", "url")  # a part that names its own image


def with_image_parts(prompt: Any, images: list, where: str) -> list[dict]:
    """The prompt as messages whose every image part holds a decoded image: {"type": "image", "image": PIL}."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = [dict(m, content=_parts(m.get("content"))) for m in messages]
    parts = [part for m in messages for part in m["content"] if part.get("type") == "image"]
    empty = [part for part in parts if not any(part.get(k) is not None for k in OWN_IMAGE_KEYS)]
    if not parts and images:
        first = next((m for m in messages if m.get("role") == "user"), None)
        if first is None:
            raise ValueError(f"{where} has {len(images)} image(s) but no user message to put them in.")
        empty = [{"type": "image"} for _ in images]
        first["content"] = empty + first["content"]
        parts = empty
    if len(empty) != len(images):
        raise ValueError(f"{where}: the prompt has {len(empty)} image part(s) without an image but the row has "
                         f"{len(images)} image(s); give one image per empty {{'type': 'image'}} part.")
    for part, image in zip(empty, images):
        part["image"] = image
    for k, part in enumerate(parts):
        source = next(part.pop(key) for key in OWN_IMAGE_KEYS if part.get(key) is not None)
        part.pop("path", None), part.pop("url", None)
        part["image"] = _open(source, f"{where}, image part {k}")
    return messages


def images_of(messages: list[dict]) -> list:
    """The images of `with_image_parts`' messages, in order."""
    return [part["image"] for m in messages for part in m["content"] if part.get("type") == "image"]


def _open(source: Any, where: str):
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        from transformers.image_utils import load_image as fetch

        return fetch(source)
    return load_image(source, where)


def _parts(content: Any) -> list[dict]:
    """A message's content as a list of parts, keys holding None dropped (a string becomes one text part; OpenAI's
    {"type": "image_url", "image_url": {"url": ...}} an image part with that url); every part a fresh dict."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    # keys holding None are the Arrow schema's merge of the parts' keys (a text part gets "image_url": None): dropped
    parts = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part for part in content]
    return [_image_url(part) if isinstance(part, dict) and part.get("type") == "image_url" else dict(part)
            for part in parts]


def _image_url(part: dict) -> dict:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return {"type": "image", "url": url}
