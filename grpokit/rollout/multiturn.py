"""Multi-turn rollouts on top of any rollout engine: the model writes a turn, its tool calls run (or its
environment answers), the results are appended to the context, and generation continues.

    runner = MultiTurn(tokenizer, toolbox, call_format, eos_ids, conversational, max_iterations)
    episodes = runner.run(generate, prompt_ids, sample_ids, params, environments, return_logprobs)

One episode, for one completion:

    prompt [+ environment.reset(**row)]  ->  turn 1 (model)  ->  tool results | observation  ->  turn 2 (model) ...

It ends when a turn has no tool call (and the environment, if it has `respond`, returns None for it), when
`max_iterations` rounds of tool results / observations were appended, or when the completion budget
(`params.max_completion_length`, for the whole transcript after the prompt, tool tokens included) runs out. The
transcript is one token sequence: the model's tokens are concatenated with the tool tokens exactly as the engine
saw them (never re-tokenised), so one forward pass over prompt + transcript gives, at the model's positions,
the log-probs each turn was sampled from. `tool_mask` marks which tokens the model wrote (1) and which a tool or
environment wrote (0, TRL's convention); the trainer multiplies it into the loss mask, so tool tokens are context
only: never in the loss, the KL, the entropy or the metrics of model tokens.

Where results go: with conversational prompts, tool results are `{"role": "tool"}` messages and observations
`{"role": "user"}` messages, rendered by the model's chat template (the tokens a template adds after an assistant
turn ending in EOS, found by rendering a small conversation with and without the new messages). That needs a
prefix-preserving template; for a stock template that is not (Qwen3, GPT-OSS), grpokit's training version of it
(grpokit.chat_templates) renders these tokens, with a warning, while prompts keep the tokenizer's own template.
With plain-text prompts, the tool-call format writes results as text (`render_results`) and observations are
appended as they are.

Randomness: turn k of the completion with sample id s is generated with sample id s + k * TURN_STRIDE, so every
turn has its own noise and the local engine's guarantee (a completion depends only on the weights, the seed and
its id) holds for whole episodes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from grpokit.chat_templates import TRAINING_TEMPLATES, training_template
from grpokit.rollout.engine import Rollout, SamplingParams, pad_rollout
from grpokit.rollout.environments import call_environment, environment_tools
from grpokit.tools.formats import ToolCall, ToolResult, bind_format
from grpokit.tools.toolbox import Toolbox

logger = logging.getLogger(__name__)

TURN_STRIDE = 1 << 44

Generate = Callable[[list[list[int]], torch.Tensor, SamplingParams], Rollout]


class MultiTurnError(ValueError):
    """The chat template or an environment cannot support multi-turn rollouts; the message says why."""


class NotPrefixPreserving(MultiTurnError):
    """The chat template renders earlier turns differently once a message follows."""


@dataclass
class Episode:
    """One completion's transcript while it is being built (token lists, parallel to each other)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 0
    truncated: bool = False
    done: bool = False

    def append(self, tokens: list[int], written_by_model: bool, logprobs: list[float] | None = None) -> None:
        self.ids += tokens
        self.tool_mask += [int(written_by_model)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


@dataclass
class Episodes:
    """A batch of finished rollouts. rollout: the transcripts after the prompts as a right-padded Rollout whose
    completion_mask covers every transcript token and whose tool_mask marks the model's own; prompt_ids: what each
    first turn continued (the prompt, plus an environment's reset text); completions: what reward functions get
    (plain prompts: the transcript's text; conversational: its messages); texts: the transcripts decoded (for
    logs); per completion: tool calls, failed calls, model turns; environments: each episode's environment
    instance (None without environments)."""

    rollout: Rollout
    prompt_ids: list[list[int]]
    completions: list[Any]
    texts: list[str]
    tool_calls: list[int]
    tool_failures: list[int]
    turns: list[int]
    environments: list[Any] | None = None
    prompts: list[Any] | None = None  # the prompts as reset() extended them (None: the dataset's)
    vision: list | None = None  # each prompt's images (grpokit.vision.PromptVision or None), single-turn only


NOT_PREFIX_PRESERVING = (
    "The chat template renders a conversation differently once a message is added after an assistant turn, so "
    "the tool/observation tokens cannot be appended to the generated ones."
)


def _known_rewrites() -> str:
    return "; ".join(f"{name} ({TRAINING_TEMPLATES[name].families})" for name in TRAINING_TEMPLATES.names())


class ChatRenderer:
    """Tool results and observations as chat-template tokens appended after an assistant turn that ended in EOS.

    `training_template`: the name of grpokit's training version of the template (grpokit.chat_templates) that
    renders them, when the tokenizer's own is not prefix-preserving; None: the tokenizer's own template does."""

    def __init__(self, tokenizer, eos_ids: list[int], template_kwargs: dict[str, Any] | None = None,
                 with_tools: bool = True) -> None:
        self.tokenizer, self.eos_ids, self.kwargs = tokenizer, set(eos_ids), dict(template_kwargs or {})
        self.training_template: str | None = None
        try:
            self.check(with_tools)
        except NotPrefixPreserving:
            self._use_training_template(with_tools)

    def _use_training_template(self, with_tools: bool) -> None:
        """Swap in grpokit's training version of a stock template that is not prefix-preserving, or refuse."""
        stock = self.tokenizer.get_chat_template(self.kwargs.get("chat_template"), tools=self.kwargs.get("tools"))
        found = training_template(stock)
        if found is None:
            raise NotPrefixPreserving(
                f"{NOT_PREFIX_PRESERVING} grpokit has training versions of these templates only: "
                f"{_known_rewrites()}. Set tokenizer.chat_template (or pass processing_class=) to a template whose "
                "rendering of earlier messages does not depend on later ones, or register a rewrite in "
                "grpokit.chat_templates.TRAINING_TEMPLATES (docs/tools.md)."
            )
        name, self.kwargs["chat_template"] = found
        try:
            self.check(with_tools)
        except NotPrefixPreserving as exc:
            raise NotPrefixPreserving(f"{exc} (Even grpokit's training version {name!r} of this template is not; "
                                      "set tokenizer.chat_template to a prefix-preserving template.)") from exc
        self.training_template = name
        logger.warning(
            "The chat template renders earlier turns differently once a message follows (as the stock templates of "
            "%s do), so the tool results and environment answers of episodes are rendered by grpokit's training "
            "version of it, %r (grpokit/chat_templates/training.py); prompts keep the tokenizer's own template.",
            TRAINING_TEMPLATES[name].families, name)

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=False, **self.kwargs)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def _suffix(self, head: list[dict], new: list[dict]) -> list[int]:
        for _ in range(2):  # twice: a template that writes today's date may cross midnight between renders
            prefix = self._ids(head, False)
            ends = [i for i, t in enumerate(prefix) if t in self.eos_ids]
            if ends:  # some templates add "\n" after the end-of-turn token: the suffix starts right after the EOS
                prefix = prefix[: ends[-1] + 1]
            full = self._ids(head + new, True)
            if full[: len(prefix)] == prefix:
                return full[len(prefix):]
        raise NotPrefixPreserving(f"{NOT_PREFIX_PRESERVING} Use a template whose rendering of earlier messages does "
                                  "not depend on later ones.")

    def tool_suffix(self, results: list[ToolResult]) -> list[int]:
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        calls = [ToolCall(r.name).as_message_call() for r in results]
        try:
            return self._suffix(self._tool_head(calls), messages)
        except MultiTurnError:
            raise
        except Exception:  # noqa: BLE001 - templates of one call per turn (Llama 3.x) raise on several
            if len(calls) == 1:
                raise
            return self._suffix(self._tool_head(calls[:1]), messages)

    @staticmethod
    def _tool_head(calls: list[dict]) -> list[dict]:
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]

    def observation_suffix(self, text: str) -> list[int]:
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        return self._suffix(head, [{"role": "user", "content": text}])

    def check(self, with_tools: bool = True) -> None:
        """The template must append a user turn after an assistant turn without re-rendering it; with tools, also
        show a tool call's name, its arguments and the tool's answer (TRL's check), and append a tool turn."""
        try:  # a template that re-renders earlier turns (Qwen3 drops empty think blocks) fails here, not later
            self.observation_suffix("observation_7c1d")
        except MultiTurnError:
            raise
        except Exception as exc:  # noqa: BLE001 - any template error means the same thing here
            raise MultiTurnError(f"The chat template cannot render a user turn after an assistant turn ({exc}).") from exc
        if with_tools:
            self._check_tools()

    def _check_tools(self) -> None:
        name, key, value, answer = "tool_name_c1e4", "arg_key_7b2d", "arg_value_5f0a", "tool_answer_9d3e"
        messages = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
            {"role": "tool", "name": name, "content": answer},
        ]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - any template error means the same thing here
            raise MultiTurnError(f"The chat template cannot render a tool-calling conversation with these tools "
                                 f"({type(exc).__name__}: {exc}).") from exc
        missing = [what for what, mark in (("the tool call's name", name), ("its arguments", value),
                                           ("the tool message", answer)) if mark not in text]
        if missing:
            raise MultiTurnError(
                f"The chat template drops {', '.join(missing)} of a tool-calling conversation, so the model would "
                "never see its tools' results; use a tokenizer whose template supports tools (e.g. Qwen2.5's), set "
                "tokenizer.chat_template, or use plain-text prompts with a tool_call_format."
            )
        try:
            self.tool_suffix([ToolResult(name, answer)])
        except MultiTurnError:
            raise
        except Exception as exc:  # noqa: BLE001 - any template error means the same thing here
            raise MultiTurnError(f"The chat template cannot render a tool result ({exc}).") from exc


class TextRenderer:
    """Plain-text prompts: results written by the tool-call format, observations appended as they are."""

    def __init__(self, tokenizer, call_format) -> None:
        self.tokenizer, self.format = tokenizer, call_format

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tool_suffix(self, results: list[ToolResult]) -> list[int]:
        return self._ids(self.format.render_results(results))

    def observation_suffix(self, text: str) -> list[int]:
        return self._ids(text)


class MultiTurn:
    """The episode loop over any `generate` function (the trainer passes its engine's).

    toolbox: the standalone tools (environment methods are added per episode); call_format: parses turns;
    conversational: prompts are chats (results become messages) or text; max_iterations: rounds of tool results or
    observations per episode (None: only the completion budget limits them); chat_template_kwargs: passed to the
    template (give the tool schemas as "tools", so the check renders what the prompts will); with_tools: whether
    any tool can be called (without, the template need not render tool calls).
    """

    def __init__(self, tokenizer, toolbox: Toolbox, call_format, eos_ids: list[int], conversational: bool,
                 max_iterations: int | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 with_tools: bool = True) -> None:
        self.tokenizer, self.toolbox = tokenizer, toolbox
        self.format = call_format = bind_format(call_format, tokenizer, chat_template_kwargs)  # "auto" -> a format
        self.max_iterations = max_iterations
        self.conversational = conversational
        self.eos_ids = set(eos_ids)
        if not conversational and not callable(getattr(call_format, "render_results", None)):
            raise MultiTurnError(f"tool_call_format {getattr(call_format, 'name', call_format)!r} has no "
                                 "render_results(results) method, which plain-text prompts need to show results.")
        if conversational:
            self.renderer = ChatRenderer(tokenizer, eos_ids, chat_template_kwargs, with_tools)
        else:
            self.renderer = TextRenderer(tokenizer, call_format)

    def run(self, generate: Generate, prompt_ids: list[list[int]], sample_ids: torch.Tensor, params: SamplingParams,
            environments: list | None = None, return_logprobs: bool = False, vision: list | None = None) -> Episodes:
        """Every episode to its end; `prompt_ids` already include an environment's reset text. vision: each
        prompt's images (grpokit.vision.PromptVision or None), handed to `generate` as a fourth argument for the
        turn's episodes; None: text prompts, `generate` gets three."""
        episodes = [Episode(list(p)) for p in prompt_ids]
        boxes = self._toolboxes(environments, len(episodes))
        budget, version = params.max_completion_length, None
        for iteration in range(budget):  # every round appends at least one model token
            active = [i for i, e in enumerate(episodes) if not e.done]
            if not active:
                break
            room = max(budget - len(episodes[i].ids) for i in active)
            turn = generate(
                [episodes[i].prompt_ids + episodes[i].ids for i in active],
                sample_ids[active] + iteration * TURN_STRIDE,
                dataclasses.replace(params, max_completion_length=room),
                *([] if vision is None else [[vision[i] for i in active]]),
            )
            version = turn.weights_version if version is None else version
            for k, i in enumerate(active):
                self._after_turn(episodes[i], turn, k, budget, iteration, boxes[i],
                                 environments[i] if environments else None)
        return self._finish(episodes, return_logprobs, version)

    def _toolboxes(self, environments: list | None, n: int) -> list[Toolbox]:
        if not environments:
            return [self.toolbox] * n
        return [self.toolbox.with_methods(environment_tools(env)) for env in environments]

    def _after_turn(self, episode: Episode, turn: Rollout, k: int, budget: int, iteration: int, box: Toolbox,
                    environment: Any) -> None:
        """Append turn k of the batch to the episode; run its tool calls or let its environment respond; decide
        whether it ends."""
        mask = turn.completion_mask[k].bool()
        tokens = turn.completion_ids[k][mask].tolist()
        logprobs = turn.logprobs[k][mask].tolist() if turn.logprobs is not None else None
        room = budget - len(episode.ids)
        cut = len(tokens) > room
        if cut:
            tokens, logprobs = tokens[:room], (logprobs[:room] if logprobs is not None else None)
        episode.append(tokens, True, logprobs)
        episode.turns += 1
        raw = self._raw_text(tokens)
        calls = self.format.parse(raw) if box.functions else []
        message = self._message(raw, tokens, calls)
        episode.messages.append(message)
        text = message["content"] if isinstance(message["content"], str) else raw  # what respond() reads
        if cut or bool(turn.truncated[k]):
            episode.truncated = episode.done = True
            return
        limit_reached = self.max_iterations is not None and iteration >= self.max_iterations
        responds = environment is not None and callable(getattr(environment, "respond", None))
        messages, suffix = [], None
        if calls and not limit_reached:
            results = box.run(calls)
            episode.tool_calls += len(results)
            episode.tool_failures += sum(r.failed for r in results)
            messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            suffix = self.renderer.tool_suffix(results)
        elif not calls and responds:  # past the limit too: the environment sees the final answer
            observation = call_environment(environment, "respond", text)
            if observation is not None and not limit_reached:
                messages = [{"role": "user", "content": observation}]
                suffix = self.renderer.observation_suffix(observation)
        if suffix is None:
            episode.done = True
        elif len(episode.ids) + len(suffix) >= budget:  # no room to read the result and answer: it is dropped
            episode.truncated = episode.done = True
        else:
            episode.messages += messages
            episode.append(suffix, False)

    def _raw_text(self, tokens: list[int]) -> str:
        """The turn as formats read it: special tokens kept (some formats mark calls with them), without the
        end-of-turn token."""
        while tokens and tokens[-1] in self.eos_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _message(self, raw: str, tokens: list[int], calls: list[ToolCall]) -> dict[str, Any]:
        """The assistant message of a turn: the format's `message(raw)` fields, else the text (without special
        tokens; without the calls when the format has `content`), plus the calls as `tool_calls`."""
        if callable(getattr(self.format, "message", None)):
            message = {"role": "assistant", "content": "", **self.format.message(raw)}
        else:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            has_content = calls and callable(getattr(self.format, "content", None))
            message = {"role": "assistant", "content": self.format.content(text) if has_content else text}
        if calls:
            message["tool_calls"] = [c.as_message_call() for c in calls]
        return message

    def _finish(self, episodes: list[Episode], return_logprobs: bool, weights_version: int | None) -> Episodes:
        rollout = pad_rollout(
            [e.ids for e in episodes], [e.logprobs for e in episodes] if return_logprobs else None, [],
            self.tokenizer.pad_token_id, weights_version, [e.tool_mask for e in episodes],
            [e.truncated for e in episodes],
        )
        texts = [self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
        completions = [e.messages for e in episodes] if self.conversational else texts
        return Episodes(rollout, [e.prompt_ids for e in episodes], completions, texts,
                        [e.tool_calls for e in episodes], [e.tool_failures for e in episodes],
                        [e.turns for e in episodes])
