"""A dataset row's images, as TRL reads them: an `images` column (a list per row) wins over an `image` column (one
per row; None: no image). Each image may be a PIL image, a path, bytes, or the dict the datasets `Image` feature
stores ({"bytes": ..., "path": ...}, as with `decode=False`); it is opened and decoded here, so a broken file fails
up front, named by its row, not inside a processor mid-run."""

from __future__ import annotations

import io
import os
from typing import Any

IMAGE_COLUMNS = ("image", "images")  # TRL's names; `images` wins when both are present


class ImageError(ValueError):
    """An image of the dataset cannot be used; the message names the row and says what to fix."""


def row_images(row: dict[str, Any], where: str) -> list:
    """The PIL images of one row (an empty list: none), decoded. `where` names the row in errors."""
    if row.get("images") is not None:
        values = row["images"]
        if not isinstance(values, (list, tuple)):
            raise ImageError(f"{where}: the 'images' column holds a {type(values).__name__}; it must be a list of "
                             "images per row (use the 'image' column for one image per row).")
        column = "images"
    elif row.get("image") is not None:
        values, column = [row["image"]], "image"
    else:
        return []
    return [load_image(value, f"{where}, column {column!r}" + (f" item {k}" if column == "images" else ""))
            for k, value in enumerate(values)]


def load_image(value: Any, where: str):
    """A decoded PIL image from a PIL image, a path, bytes or {"bytes", "path"}; ImageError naming `where`."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return eight_bit(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
        if value is None:
            raise ImageError(f"{where}: the datasets Image value holds neither bytes nor a path; fix or drop the row.")
    if isinstance(value, (bytes, bytearray)) and not value:
        raise ImageError(f"{where}: the image bytes are empty; fix or drop the row.")
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        raise ImageError(f"{where}: an image must be a PIL image, a file path, bytes or a datasets Image value, got "
                         f"an array ({type(value).__name__}: datasets stores numpy arrays and tensors as nested "
                         "lists); convert it with PIL.Image.fromarray(array.astype('uint8')).")
    try:
        if isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(value)
        else:
            raise ImageError(f"{where}: an image must be a PIL image, a file path, bytes or a datasets Image value "
                             f"({{'bytes', 'path'}}), got {type(value).__name__}.")
        image.load()
        image = ImageOps.exif_transpose(image)  # a photo's orientation, as transformers' load_image applies it
    except FileNotFoundError as exc:
        relative = "" if os.path.isabs(str(value)) else f" (relative paths are read from {os.getcwd()})"
        raise ImageError(f"{where}: the image file {str(value)!r} does not exist{relative}.") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        shown = repr(str(value)) if isinstance(value, (str, os.PathLike)) else f"{len(value)} bytes"
        raise ImageError(f"{where}: the image ({shown}) cannot be decoded: {type(exc).__name__}: {exc}. "
                         "Fix or drop the row.") from exc
    return eight_bit(image)


def eight_bit(image):
    """A 16-bit or 32-bit grey image (modes I;16*, I, F) scaled to 8 bits: converting it to RGB would clip every
    value above 255 to white. Other images as they are."""
    if not image.mode.startswith(("I;16", "I", "F")):
        return image
    import numpy as np
    from PIL import Image

    values = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") else max(float(values.max()), 255.0)
    return Image.fromarray(np.clip(values / top * 255.0, 0, 255).astype(np.uint8))  # an (H, W) uint8 array: mode L


def thumbnail_uri(image, side: int = 96) -> str:
    """The image shrunk to at most `side` pixels a side, as a PNG data URI (completions.jsonl, the run report)."""
    import base64

    small = image.convert("RGB").copy()
    small.thumbnail((side, side))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
