"""A learned reward model: an AutoModelForSequenceClassification whose first logit is the reward.

    r_i = logits(tokenize(text_i))[0]

text_i is prompt + completion for plain text, or the chat template applied to the prompt messages followed by
the completion messages for conversational data. Scoring is batched, in eval mode, under torch.inference_mode.

Only a trained score head is used: a checkpoint that would load with any weight newly initialised (a causal LM's
folder has no score head, and transformers would give it a random one) and a causal LM given as an object are
refused, and so is a folder whose weights cannot be read, each with a ModelError naming the path.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from grpokit.rewards.text import completion_text


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_display_name(path_or_name: str) -> str:
    """Metric name of a model: the last component of a local path or hub name ("org/rm-7b" -> "rm-7b")."""
    return os.path.basename(os.path.normpath(path_or_name)) or path_or_name


def load_reward_model(path: str, dtype: torch.dtype | str | None = None) -> Any:
    """AutoModelForSequenceClassification.from_pretrained(path), refused (ModelError naming the path) when the
    weights cannot be read or when any weight would be newly initialised: a causal LM's folder has no score head."""
    from safetensors import SafetensorError
    from transformers import AutoModelForSequenceClassification

    from grpokit.models.loading import ModelError

    _refuse_generative_checkpoint(path)
    load_kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True, **load_kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        raise ModelError(f"The weights of reward model {path!r} cannot be read: {type(exc).__name__}: {exc}") from exc
    untrained = sorted(set(info.get("missing_keys", ())) | {m[0] if isinstance(m, tuple) else m
                                                            for m in info.get("mismatched_keys", ())})
    if untrained:
        architectures = ", ".join(getattr(model.config, "architectures", None) or []) or "of another architecture"
        raise ModelError(
            f"Reward model {path!r} has no trained weights for {', '.join(untrained)}: loaded as "
            f"{type(model).__name__} they would be randomly initialised (the checkpoint is {architectures}); "
            f"{_GIVE}"
        )
    return model


_GIVE = "give a checkpoint saved from an AutoModelForSequenceClassification, with its trained score head"
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _refuse_generative_checkpoint(path: str) -> None:
    """A folder whose config names only generative architectures (Qwen2ForCausalLM, ...) is refused before its
    weights load; a config that cannot be read is left for from_pretrained to report."""
    from transformers import AutoConfig

    from grpokit.models.loading import ModelError

    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
    except (OSError, ValueError, KeyError):
        return
    if architectures and all(name.endswith(_GENERATIVE) for name in architectures):
        raise ModelError(f"Reward model {path!r} is a {', '.join(architectures)}, a generative model: loaded as a "
                         f"sequence classifier its score head would be randomly initialised; {_GIVE}")


def _check_model_object(model: Any) -> None:
    """A reward model object must not be a generative model: a causal LM's logits are next-token scores."""
    from grpokit.models.loading import ModelError

    if model.can_generate():
        raise ModelError(f"The reward model object is a {type(model).__name__}, a generative model whose logits "
                         f"are next-token scores, not a reward; {_GIVE}")


class RewardModelFunction:
    """Scores completions with a sequence-classification model: a path or hub name loaded with
    `AutoModelForSequenceClassification.from_pretrained(path_or_name)`, or a model object used as
    given (TRL's form: `reward_funcs=[AutoModelForSequenceClassification...]`). The score is logit 0.

    batch_size: texts per forward pass; max_length: truncate longer texts (None: no truncation); device: where
    the model runs (default: the current CUDA device, else CPU); dtype: passed to from_pretrained;
    tokenizer: the tokenizer object to use (TRL's reward_processing_classes), else the one loaded from
    tokenizer_path, else from the model's folder.
    """

    def __init__(
        self,
        path_or_name: Any,
        batch_size: int = 8,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        tokenizer_path: str | None = None,
        tokenizer: Any = None,
    ) -> None:
        from transformers import PreTrainedModel

        if batch_size < 1:
            raise ValueError(f"reward model batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device) if device is not None else _default_device()
        if isinstance(path_or_name, PreTrainedModel):
            _check_model_object(path_or_name)
            self.model, source = path_or_name, path_or_name.config._name_or_path
        else:
            self.model, source = load_reward_model(str(path_or_name), dtype), str(path_or_name)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        if tokenizer is None:  # loaded as saved (see grpokit.models.loading._from_pretrained_tokenizer)
            from grpokit.models.loading import _from_pretrained_tokenizer

            tokenizer = _from_pretrained_tokenizer(tokenizer_path or source)
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            # Sequence classifiers find each row's last real token through pad_token_id.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length = batch_size, max_length
        self.__name__ = model_display_name(source or type(self.model).__name__)

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The text scored for each sample (see the module docstring)."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion_text(completion))
            else:
                reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
                out.append(self.tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False))
        return out

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        templated = bool(prompts) and not isinstance(prompts[0], str)  # the chat template placed special tokens
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start:start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=not templated,
            ).to(self.device)
            logits = self.model(**batch).logits  # (B, num_labels)
            scores.extend(logits[:, 0].float().tolist())
        return scores
