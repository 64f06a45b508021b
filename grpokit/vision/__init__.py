"""Image prompts for vision-language models: a prompt's images as plain data that travels with its token ids.

- images.py: a row's images (TRL's `image` / `images` columns) from PIL images, paths, bytes or the datasets
  `Image` feature's dicts, each failure named by row.
- messages.py: TRL's rule for where a prompt's images go (one image part per image in the first user message).
- inputs.py: `PromptVision`, one prompt's processor outputs (pixels, grids, sizes, per-token type ids) and its
  images; `encode_prompt` (processor -> ids, PromptVision); `collate` (several prompts' tensors as one forward's).
- positions.py: the model's side: multimodal RoPE positions per prompt (Qwen families), computed per sample from
  the prompt alone, and the keyword arguments of a forward over prompts with images.

docs/vision.md is the user's guide; docs/vision-notes.md what each family needs through the passes.
"""

from grpokit.vision.inputs import PromptVision, collate, encode_prompt, vision_key
from grpokit.vision.images import ImageError, load_image, row_images
from grpokit.vision.messages import with_image_parts

__all__ = ["ImageError", "PromptVision", "collate", "encode_prompt", "load_image", "row_images", "vision_key",
           "with_image_parts"]
