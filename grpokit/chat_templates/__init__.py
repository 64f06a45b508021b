"""Chat templates for training: prefix-preserving versions of the stock templates that re-render earlier turns
(training.py). grpokit.rollout.multiturn swaps one in for the tool and observation tokens of an episode when the
tokenizer's own template is not prefix-preserving; prompts are always rendered by the tokenizer's own template."""

from grpokit.chat_templates.training import TRAINING_TEMPLATES, TemplateRewrite, training_template

__all__ = ["TRAINING_TEMPLATES", "TemplateRewrite", "training_template"]
