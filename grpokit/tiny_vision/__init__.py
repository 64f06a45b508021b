"""Tiny, offline vision-language models of real families, with their processors, for tests and demos.

One builder per family returns (model, processor): the family's own model, config, processor and image processor
classes, random init and tiny, and a character-level tokenizer with the family's special tokens and its chat
template verbatim (templates.py). `save` writes a folder that AutoProcessor and AutoModelForImageTextToText load
back offline. Where torchvision is missing, the Qwen families' processors need `video_processor_optional()` (the
builders and `save` call it; a process that only loads a saved Qwen folder calls it first). docs/vision-notes.md
says what each family's processor returns and how its positions and KV cache work.
"""

from grpokit.tiny_vision.build import char_tokenizer, save, video_processor_optional
from grpokit.tiny_vision.families import (
    tiny_gemma3,
    tiny_llava_next,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
    tiny_smolvlm,
)

# family name -> builder; every builder takes (hidden_size, num_layers, image_size, seed) keywords
FAMILIES = {
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
    "gemma3": tiny_gemma3,
    "llava_next": tiny_llava_next,
    "smolvlm": tiny_smolvlm,
}

__all__ = ["FAMILIES", "char_tokenizer", "save", "tiny_gemma3", "tiny_llava_next", "tiny_qwen2_5_vl", "tiny_qwen2_vl",
           "tiny_qwen3_vl", "tiny_smolvlm", "video_processor_optional"]
