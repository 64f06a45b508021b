"""A vision-language model's processor, loaded as TRL loads it."""

from __future__ import annotations

import logging
from pathlib import Path

from grpokit.models.loading import ModelError
from grpokit.tiny_vision import video_processor_optional

logger = logging.getLogger("grpokit")


def load_processor(model, trust_remote_code: bool = False):
    """The processor saved beside a vision-language model (AutoProcessor, as TRL loads it). Where torchvision is
    missing, a processor that lists a video sub-processor (the Qwen families) loads without it: images work,
    videos do not (grpokit.tiny_vision.video_processor_optional, logged)."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    source = model if isinstance(model, (str, Path)) else model.config._name_or_path
    if not is_torchvision_available():
        logger.info("torchvision is not installed: loading the processor without its video processor (images only).")
        video_processor_optional()
    try:
        return AutoProcessor.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelError(
            f"No processor found for the vision-language model {str(source)!r} ({type(exc).__name__}: {exc}); pass "
            "processing_class=AutoProcessor.from_pretrained(...) (the model's processor) to GRPOTrainer."
        ) from exc
