"""Multi-turn rollouts: the episode loop (scripted turns, then a real model), the tool mask in the loss, the log-probs
of a transcript, environments, and training through GRPOTrainer with tools."""

import re

import datasets
import pytest
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.config import ConfigError
from grpokit.passes import completion_logprobs
from grpokit.rollout.engine import SamplingParams, pad_rollout
from grpokit.rollout.generate import generate_completions, left_pad
from grpokit.rollout.multiturn import TURN_STRIDE, MultiTurn
from grpokit.tiny import TOOL_CHAT_TEMPLATE, char_tokenizer, tiny_qwen2
from grpokit.tools import TOOL_CALL_FORMATS, ToolCall, Toolbox, resolve_format
from helpers import echo, register_test_formats

EOS = "<eos>"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


register_test_formats()


class Scripted:
    """A generate function that writes scripted text: turn k of row r is script[r][k] (+ EOS unless it ends in
    '...', which stands for a turn cut by the length limit). Records every call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def __call__(self, prompt_ids, sample_ids, params):
        self.calls.append((prompt_ids, sample_ids.clone(), params))
        texts = []
        for ids, sid in zip(prompt_ids, sample_ids.tolist()):
            row, turn = sid % TURN_STRIDE, sid // TURN_STRIDE
            texts.append(self.script[row][turn])
        tokens = []
        for text in texts:
            ids = self.tokenizer(text.removesuffix("..."), add_special_tokens=False)["input_ids"]
            ids = ids + ([] if text.endswith("...") else [self.tokenizer.eos_token_id])
            tokens.append(ids[: params.max_completion_length])
        return pad_rollout(tokens, None, [self.tokenizer.eos_token_id], self.tokenizer.pad_token_id)


def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def run_script(script, tools=(add,), conversational=False, budget=600, max_iterations=None, environments=None,
               call_format="qwen", prompts=None):
    tok = chat_tokenizer()
    runner = MultiTurn(tok, Toolbox(list(tools)), resolve_format(call_format), [tok.eos_token_id], conversational,
                       max_iterations)
    if prompts is None:
        prompts = [f"q{r}:" for r in range(len(script))]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    generate = Scripted(tok, script)
    episodes = runner.run(generate, prompt_ids, torch.arange(len(script)), SamplingParams(budget), environments)
    return tok, episodes, generate


CALL = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'


# ---------------------------------------------------------------- the episode loop, scripted
def test_plain_text_episode_concatenates_model_and_tool_tokens_with_the_tool_mask():
    tok, episodes, generate = run_script([[f"Sum: {CALL}", "It is 42."], ["No tools needed."]], budget=200)
    rollout = episodes.rollout
    first = tok(f"Sum: {CALL}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    result = tok("<tool_response>\n42\n</tool_response>\n", add_special_tokens=False)["input_ids"]
    last = tok("It is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(first) + len(result) + len(last)
    assert rollout.completion_ids[0, :n].tolist() == first + result + last
    assert rollout.tool_mask[0, :n].tolist() == [1] * len(first) + [0] * len(result) + [1] * len(last)
    assert rollout.completion_mask[0].sum() == n and rollout.model_mask[0].sum() == len(first) + len(last)
    assert rollout.completion_mask[1].sum() == len("No tools needed.") + 1
    assert rollout.truncated.tolist() == [False, False]
    assert episodes.completions[0] == tok.decode(first + result + last, skip_special_tokens=True)
    assert (episodes.tool_calls, episodes.tool_failures, episodes.turns) == ([1, 0], [0, 0], [2, 1])
    # turn 2 continued exactly prompt + transcript so far, with its own noise and the remaining budget
    prompt_ids, sample_ids, params = generate.calls[1]
    assert prompt_ids == [tok("q0:", add_special_tokens=False)["input_ids"] + first + result]
    assert sample_ids.tolist() == [TURN_STRIDE] and params.max_completion_length == 200 - len(first) - len(result)


def test_every_tool_error_reaches_the_model_and_the_episode_goes_on():
    bad_calls = "<tool_call>{oops</tool_call>" + '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
    tok, episodes, _ = run_script([[bad_calls, "sorry"]], tools=[add], budget=600)
    text = episodes.completions[0]
    assert '{"error": "the tool call is not valid JSON' in text
    assert '{"error": "unknown tool \'mul\'; available tools: add"}' in text
    assert text.endswith("sorry")
    assert (episodes.tool_calls, episodes.tool_failures, episodes.turns) == ([2], [2], [2])


def test_max_tool_calling_iterations_ends_the_episode_at_the_next_call():
    _, episodes, generate = run_script([[CALL, CALL, CALL, "done"]], max_iterations=2)
    assert episodes.turns == [3] and episodes.tool_calls == [2]
    assert not episodes.rollout.truncated[0]  # it ended on a model turn, by the limit
    assert len(generate.calls) == 3
    _, episodes, _ = run_script([[CALL, "done"]], max_iterations=0)
    assert episodes.turns == [1] and episodes.tool_calls == [0]


def test_the_budget_covers_the_whole_transcript_and_a_result_that_does_not_fit_ends_it_truncated():
    tok, episodes, generate = run_script([[CALL, "It is forty-two, the answer!"]], budget=130)
    first = len(CALL) + 1
    assert first + len("<tool_response>\n42\n</tool_response>\n") + len("It is forty-two, the answer!") > 130
    assert episodes.rollout.completion_mask[0].sum() == 130  # the second turn was cut at the budget
    assert episodes.rollout.truncated.tolist() == [True]
    assert generate.calls[1][2].max_completion_length == 130 - first - len("<tool_response>\n42\n</tool_response>\n")
    _, episodes, generate = run_script([[CALL, "never"]], budget=len(CALL) + 5)
    assert len(generate.calls) == 1 and episodes.rollout.truncated.tolist() == [True]  # no room for the result
    assert episodes.rollout.tool_mask[0].sum() == episodes.rollout.completion_mask[0].sum() == len(CALL) + 1


def test_conversational_transcript_is_exactly_the_chat_template_rendering_of_the_conversation():
    tok = chat_tokenizer()
    prompt = [{"role": "user", "content": "What is 20+22?"}]
    tools = Toolbox([add]).schemas
    prompt_text = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    _, episodes, _ = run_script([[f"Let me add. {CALL}", "42"]], conversational=True, prompts=[prompt_text])
    ids = episodes.prompt_ids[0] + episodes.rollout.completion_ids[0][episodes.rollout.completion_mask[0].bool()].tolist()
    conversation = prompt + [
        {"role": "assistant", "content": f"Let me add. {CALL}"},  # the call as the model wrote it
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    expected = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert tok.decode(ids) == expected.removesuffix("\n")
    assert episodes.completions[0] == [
        {"role": "assistant", "content": "Let me add.",  # the call is in tool_calls, not twice
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 20, "b": 22}}}]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]


class Countdown:
    """An environment that responds: it answers each guess with 'higher'/'lower' and scores the last one."""

    def reset(self, target, **row):
        self.target, self.guesses = int(target), []
        return " (guess a number below 10)"

    def respond(self, text):
        self.guesses.append(int(text) if text.strip().isdigit() else -1)
        if self.guesses[-1] == self.target:
            return None
        return "higher" if self.guesses[-1] < self.target else "lower"

    def get_reward(self):
        return 1.0 if self.guesses and self.guesses[-1] == self.target else 0.0


def test_responding_environment_answers_each_turn_until_it_returns_none():
    env = Countdown()
    env.reset(target=7)
    tok, episodes, _ = run_script([["3", "8", "7"]], tools=(), environments=[env])
    assert episodes.completions[0] == "3higher8lower7"
    assert env.guesses == [3, 8, 7] and env.get_reward() == 1.0
    assert episodes.turns == [3] and episodes.tool_calls == [0]
    mask = episodes.rollout.tool_mask[0][episodes.rollout.completion_mask[0].bool()].tolist()
    assert mask == [1, 1] + [0] * 6 + [1, 1] + [0] * 5 + [1, 1]  # "3<eos>" "higher" "8<eos>" "lower" "7<eos>"


# ---------------------------------------------------------------- a real model: log-probs of the transcript
def test_log_probs_of_the_model_tokens_equal_one_forward_over_the_whole_transcript():
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=2, seed=3).eval()
    runner = MultiTurn(tok, Toolbox([echo]), resolve_format("test_every_turn"), [tok.eos_token_id], False, 3)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["ab=", "ab=", "a longer prompt="]]
    params = SamplingParams(max_completion_length=40, temperature=0.7)

    def generate(ids, sample_ids, turn_params):
        return generate_completions(model, tok, ids, sample_ids, turn_params, seed=5, return_logprobs=True)

    episodes = runner.run(generate, prompts, torch.arange(3), params, return_logprobs=True)
    rollout = episodes.rollout
    assert (rollout.tool_mask == 0).logical_and(rollout.completion_mask == 1).any()  # tool tokens in between
    assert max(episodes.turns) >= 2
    prompt_ids, prompt_mask = left_pad(episodes.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask,
                                      0.7)
    model_tokens = rollout.model_mask.bool()
    assert torch.allclose(logp[model_tokens], rollout.logprobs[model_tokens], atol=2e-5)
    assert (rollout.logprobs[~model_tokens] == 0).all()


# ---------------------------------------------------------------- GRPOTrainer with tools
def _config(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, per_device_train_batch_size=8,
                   max_completion_length=32, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                   beta=0.04, tool_call_format="test_every_turn", max_tool_calling_iterations=2)
    options.update(overrides)
    return GRPOConfig(**options)


def length_reward(completions, **kwargs):
    return [float(len(c)) / 10 for c in completions]


def test_trainer_masks_tool_tokens_out_of_the_loss_and_logs_tool_metrics(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, length_reward, args=_config(tmp_path), train_dataset=prompt_dataset,
                          tools=[echo])
    seen = []
    original = trainer.learner.step

    def spy(exp, *args):
        seen.append(exp)
        return original(exp, *args)

    trainer.learner.step = spy
    trainer.train()
    exp = seen[0]
    assert torch.equal(exp.loss_mask, exp.completion_mask * (exp.loss_mask > 0).long())
    tool_tokens = exp.completion_mask.bool() & (exp.loss_mask == 0)
    assert tool_tokens.any(), "the run should have appended tool results"
    # each tool result is "[" + up to 3 capitals + "]": check the masked tokens are exactly those characters
    masked_text = "".join(trainer.tokenizer.convert_ids_to_tokens(exp.completion_ids[tool_tokens].tolist()))
    assert set(masked_text) <= set("[]" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!\"#$%&'()*+,-./:;<=>?@\\^_`{|}~ \n")
    row = trainer.state.log_history[0]
    assert row["tools/call_frequency"] > 0 and row["tools/failure_frequency"] == 0.0
    assert row["tools/turns_mean"] > 1
    assert row["completions/tool_tokens_mean"] == pytest.approx(
        (exp.completion_mask.sum() - exp.completion_mask.mul(exp.loss_mask > 0).sum()).item() / 8)
    assert row["completions/mean_length"] == pytest.approx((exp.loss_mask > 0).sum().item() / 8)


def test_reward_functions_get_the_transcript_and_environments_score_with_get_reward(tmp_path, tiny_model_dir):
    seen = {}

    class Lookup:
        def reset(self, key, **row):
            self.key, self.asked = key, []
            return f" [{key}]"

        def lookup(self, text: str) -> str:
            """Look a text up.

            Args:
                text: What to look up.
            """
            self.asked.append(text)
            return self.key.upper()

        def get_reward(self):
            return float(len(self.asked))

    @TOOL_CALL_FORMATS.register("test_lookup_every_turn")
    class LookupEveryTurn:
        name = "test_lookup_every_turn"

        def parse(self, text):
            return [ToolCall("lookup", {"text": text[:2]})]

        def render_results(self, results):
            return "".join(f"<{r.content}>" for r in results)

    def spy(completions, environments, key, **kwargs):
        seen["completions"], seen["environments"], seen["key"] = completions, environments, key
        return [0.0] * len(completions)

    dataset = datasets.Dataset.from_list([{"prompt": f"q{i}", "key": f"k{i}"} for i in range(4)])
    args = _config(tmp_path, tool_call_format="test_lookup_every_turn", max_steps=1)
    trainer = GRPOTrainer(tiny_model_dir, spy, args=args, train_dataset=dataset, environment_factory=Lookup)
    assert trainer.reward_names == trainer.reward_func_names == ["spy", "Lookup"]  # TRL's attribute name too
    steps = []
    step = trainer.learner.step
    trainer.learner.step = lambda exp, *args: steps.append(exp) or step(exp, *args)
    trainer.train()
    envs = seen["environments"]
    assert len(envs) == 8 and all(isinstance(e, Lookup) for e in envs)
    assert len({id(e) for e in envs}) == 8  # one instance per episode
    shown = 0
    for env, key, text in zip(envs, seen["key"], seen["completions"]):
        assert env.key == key
        # the transcript holds every tool result, but a last one that no longer fits in max_completion_length
        assert len(env.asked) - text.count(f"<{key.upper()}>") in (0, 1)
        shown += text.count(f"<{key.upper()}>")
    assert shown > 0
    row = trainer.state.log_history[0]
    assert row["rewards/Lookup/mean"] == pytest.approx(sum(len(e.asked) for e in envs) / 8)
    # reset's text was appended to each prompt
    prompts = [trainer.tokenizer.decode(p) for p in steps[0].prompt_ids.tolist()]
    assert all(p.replace("<pad>", "").endswith(f" [{key}]") for p, key in zip(prompts, seen["key"]))


def test_bad_tool_setups_fail_before_the_model_loads(tmp_path, prompt_dataset):
    missing = str(tmp_path / "no-model-here")  # loading it would fail with another error

    def bare(x):
        return x

    with pytest.raises(ConfigError, match="'bare' cannot be described"):
        GRPOTrainer(missing, length_reward, args=_config(tmp_path), train_dataset=prompt_dataset, tools=[bare])
    with pytest.raises(ConfigError, match="without a reset"):
        GRPOTrainer(missing, length_reward, args=_config(tmp_path), train_dataset=prompt_dataset,
                    environment_factory=lambda: object())
    with pytest.raises(ConfigError, match="needs an 'environment' column"):
        GRPOTrainer(missing, length_reward, args=_config(tmp_path), train_dataset=prompt_dataset,
                    environment_factory={"a": Countdown})
    def broken_factory():
        raise OSError("no such game file")

    with pytest.raises(ConfigError, match=r"environment_factory\(\) raised OSError: no such game file"):
        GRPOTrainer(missing, length_reward, args=_config(tmp_path), train_dataset=prompt_dataset,
                    environment_factory=broken_factory)
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(missing, None, args=_config(tmp_path), train_dataset=prompt_dataset, tools=[echo])
    with pytest.raises(ConfigError, match="tool_call_format"):
        _config(tmp_path, tool_call_format="nope")
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=-1"):
        _config(tmp_path, max_tool_calling_iterations=-1)
    with pytest.raises(ConfigError, match="tool_timeout"):
        _config(tmp_path, tool_timeout=float("nan"))


def test_conversational_prompts_need_a_template_that_renders_tools(tmp_path, tiny_model_dir):
    chat = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+{i}?"}]} for i in range(4)])
    with pytest.raises(ConfigError, match="chat template drops"):
        GRPOTrainer(tiny_model_dir, length_reward, args=_config(tmp_path), train_dataset=chat, tools=[echo])
    tok = chat_tokenizer()
    trainer = GRPOTrainer(tiny_model_dir, length_reward, args=_config(tmp_path, max_steps=1), train_dataset=chat,
                          tools=[echo], processing_class=tok)
    assert tok.decode(trainer.prompt_ids[0]) == "system: tools echo \nuser: 0+0?\nassistant: "
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] > 0


def test_dynamic_sampling_moves_whole_episodes_with_their_tool_masks(tmp_path, tiny_model_dir, prompt_dataset):
    """Groups of even prompts score flat and are dropped; the kept episodes are recomposed (Collector.compose) with their
    prompt ids, tool masks and truncation flags."""

    def flat_for_even(prompts, completions, **kwargs):
        return [1.0 if int(p.split("+")[0]) % 2 == 0 else len(c) / 10 for p, c in zip(prompts, completions)]

    args = _config(tmp_path, max_steps=1, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    trainer = GRPOTrainer(tiny_model_dir, flat_for_even, args=args, train_dataset=prompt_dataset, tools=[echo])
    steps = []
    step = trainer.learner.step
    trainer.learner.step = lambda exp, *args: steps.append(exp) or step(exp, *args)
    trainer.train()
    row = trainer.state.log_history[0]
    assert row["dynamic_sampling/rounds"] >= 2 and row["dynamic_sampling/dropped_groups"] >= 1
    exp = steps[0]
    tool_tokens = exp.completion_mask.bool() & (exp.loss_mask == 0)
    assert tool_tokens.any()
    for ids, mask, loss_mask in zip(exp.completion_ids, exp.completion_mask, exp.loss_mask):
        # the masked tokens of each episode are exactly its tool results, "[" + capitals + "]" each
        tool_text = "".join(trainer.tokenizer.convert_ids_to_tokens(ids[mask.bool() & (loss_mask == 0)].tolist()))
        assert re.fullmatch(r"(\[[^a-z]{0,3}\])*", tool_text), tool_text
    prompts = [trainer.tokenizer.decode(p, skip_special_tokens=True) for p in exp.prompt_ids]
    assert sum(int(p.split("+")[0]) % 2 == 1 for p in prompts) >= len(prompts) // 2  # mostly informative groups


def test_a_single_tool_function_is_accepted_and_a_failing_reset_names_the_environment(tmp_path, tiny_model_dir,
                                                                                        prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, length_reward, args=_config(tmp_path, max_steps=1),
                          train_dataset=prompt_dataset, tools=echo)
    assert list(trainer.toolbox.functions) == ["echo"]

    class Fragile:
        def reset(self, answer, **row):
            raise KeyError(answer)

    trainer = GRPOTrainer(tiny_model_dir, length_reward, args=_config(tmp_path, max_steps=1),
                          train_dataset=prompt_dataset, environment_factory=Fragile)
    with pytest.raises(ValueError, match=r"Fragile.reset\(\) raised KeyError: .*row columns: prompt, answer, task"):
        trainer.train()


def test_tools_from_the_config_and_the_command_line_form(tmp_path, tiny_model_dir, prompt_dataset):
    args = _config(tmp_path, max_steps=1, tools=["grpokit.tools:calculator"], tool_call_format="qwen")
    trainer = GRPOTrainer(tiny_model_dir, length_reward, args=args, train_dataset=prompt_dataset, tools=[echo])
    assert sorted(trainer.toolbox.functions) == ["calculator", "echo"]
    from grpokit.config import coerce_option

    assert coerce_option("tools", "calculator, grpokit.tools:python") == ["calculator", "grpokit.tools:python"]



# ---------------------------------------------------------------- found in review: hostile models, tools, environments
def test_max_iterations_still_shows_the_final_answer_to_the_environment():
    env = Countdown()
    env.reset(target=7)
    _, episodes, _ = run_script([["9", "8", "7"]], tools=(), environments=[env], max_iterations=2)
    assert env.guesses == [9, 8, 7] and env.get_reward() == 1.0
    env.reset(target=7)
    _, episodes, _ = run_script([["9", "8", "6", "7"]], tools=(), environments=[env], max_iterations=2)
    assert env.guesses == [9, 8, 6] and episodes.turns == [3]  # the third answer is seen, then the episode ends


def test_a_result_that_does_not_fit_is_neither_in_the_tokens_nor_in_the_messages():
    tok = chat_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tools=Toolbox([add]).schemas,
                                     add_generation_prompt=True, tokenize=False)
    _, episodes, _ = run_script([[CALL, "never"]], conversational=True, prompts=[prompt], budget=len(CALL) + 5)
    assert [m["role"] for m in episodes.completions[0]] == ["assistant"]
    assert episodes.rollout.truncated.tolist() == [True] and episodes.tool_calls == [1]  # it ran and counts


def test_a_trl_environment_with_a_tool_called_step_keeps_it_as_a_tool():
    class Game:
        def reset(self, **row):
            self.moves = []

        def step(self, action: str) -> str:
            """Make a move.

            Args:
                action: The move.
            """
            self.moves.append(action)
            return "ok"

    env = Game()
    env.reset()
    call = '<tool_call>{"name": "step", "arguments": {"action": "left"}}</tool_call>'
    _, episodes, _ = run_script([[call, "done"]], tools=(), environments=[env])
    assert env.moves == ["left"] and episodes.tool_calls == [1] and episodes.turns == [2]


def test_environment_methods_run_in_the_calling_thread_and_a_failing_respond_names_itself():
    import threading

    class Local:
        def reset(self, **row):
            self.thread = threading.get_ident()

        def where(self) -> str:
            """Say whether this runs where reset ran."""
            return "same" if threading.get_ident() == self.thread else "other"

        def respond(self, text):
            if text == "boom":
                raise LookupError("no such state")

    env = Local()
    env.reset()
    call = '<tool_call>{"name": "where", "arguments": {}}</tool_call>'
    _, episodes, _ = run_script([[call, "done"]], tools=(), environments=[env])
    assert "same" in episodes.completions[0]
    with pytest.raises(ValueError, match=r"Local.respond\(\) raised LookupError: no such state"):
        run_script([["boom"]], tools=(), environments=[env])


def test_a_template_that_re_renders_earlier_turns_is_refused_up_front():
    from grpokit.rollout.multiturn import ChatRenderer, MultiTurnError

    tok = chat_tokenizer()
    # like Qwen3's: the last assistant turn is rendered with an extra block that disappears once a message follows
    tok.chat_template = TOOL_CHAT_TEMPLATE.replace(
        "{% if m['role'] == 'assistant' %}assistant: ",
        "{% if m['role'] == 'assistant' %}assistant: {% if loop.last %}<think></think>{% endif %}")
    with pytest.raises(MultiTurnError, match="renders a conversation differently"):
        ChatRenderer(tok, [tok.eos_token_id])


def test_prompts_extended_by_reset_reach_rewards_and_are_checked_against_max_prompt_length(tmp_path, tiny_model_dir):
    class Long:
        def reset(self, **row):
            return " and some context"

    seen = {}

    def spy(prompts, completions, **kwargs):
        seen["prompts"] = prompts
        return [0.0] * len(completions)

    chat = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}] * 4)
    dataset = datasets.Dataset.from_list([{"prompt": f"q{i}"} for i in range(4)])
    trainer = GRPOTrainer(tiny_model_dir, spy, args=_config(tmp_path, max_steps=1, max_prompt_length=40),
                          train_dataset=dataset, environment_factory=Long)
    trainer.train()
    assert all(p.endswith(" and some context") for p in seen["prompts"])
    trainer = GRPOTrainer(tiny_model_dir, spy, args=_config(tmp_path, max_steps=1, max_prompt_length=5),
                          train_dataset=dataset, environment_factory=Long)
    with pytest.raises(ValueError, match=r"reset\(\) made a prompt 19 tokens long, more than max_prompt_length \(5\)"):
        trainer.train()
    from grpokit.train.collector import with_observation as _with_observation

    assert _with_observation(chat[0]["prompt"], " more")[-1]["content"] == [
        {"type": "text", "text": "hi"}, {"type": "text", "text": " more"}]
    assert _with_observation([{"role": "user", "content": None}], "x")[-1]["content"] == "x"


def test_eval_sets_are_checked_for_environments_and_templates_that_fail_on_tools_are_config_errors(tmp_path):
    missing = str(tmp_path / "no-model-here")
    train = datasets.Dataset.from_list([{"prompt": "q", "environment": "a"}] * 2)
    bad_eval = datasets.Dataset.from_list([{"prompt": "q"}] * 2)
    with pytest.raises(ConfigError, match="needs an 'environment' column"):
        GRPOTrainer(missing, length_reward, args=_config(tmp_path), train_dataset=train, eval_dataset=bad_eval,
                    environment_factory={"a": Countdown})


def test_format_objects_in_the_config_and_formats_without_render_results(tmp_path, tiny_model_dir, prompt_dataset):
    class ParseOnly:
        name = "parse_only"

        def parse(self, text):
            return []

    with pytest.raises(ConfigError, match="neither a format name nor an object with a parse"):
        _config(tmp_path, tool_call_format=42)
    args = _config(tmp_path, tool_call_format=ParseOnly())
    with pytest.raises(ConfigError, match="has no render_results"):
        GRPOTrainer(tiny_model_dir, length_reward, args=args, train_dataset=prompt_dataset, tools=[echo])


def test_an_environment_that_owns_the_data_needs_no_dataset_or_prompt_column(tmp_path, tiny_model_dir):
    seen = []

    class Owner:
        def reset(self, **row):
            seen.append(dict(row))
            return "Guess the word."

    def spy(prompts: list, completions, **kwargs):
        assert all(p[-1]["content"] == "Guess the word." for p in prompts)  # reset() wrote the prompt
        return [float(len(c[-1]["content"])) for c in completions]

    args = _config(tmp_path, max_steps=2)
    trainer = GRPOTrainer(tiny_model_dir, spy, args=args, environment_factory=Owner)
    assert len(trainer.train_dataset) == 2  # one generation batch of prompts: 8 completions / 4 per prompt
    trainer.train()
    assert seen and all(row == {} for row in seen)  # the placeholder prompt is not a reset() argument
    routed = datasets.Dataset.from_dict({"environment": ["a", "b"] * 2})

    class B(Owner):
        pass

    trainer = GRPOTrainer(tiny_model_dir, spy, args=_config(tmp_path, max_steps=1), train_dataset=routed,
                          environment_factory={"a": Owner, "b": B})
    trainer.train()
    assert {tuple(sorted(r)) for r in seen[-8:]} == {()}  # the environment column is not passed either
    class Scored(Owner):
        def get_reward(self):
            return 1.0

        def hint(self, letter: str) -> str:
            """Say whether a letter is in the word.

            Args:
                letter: The letter.
            """
            return "no"

    trainer = GRPOTrainer(tiny_model_dir, None, args=args, environment_factory=Scored,  # get_reward: the only reward
                          processing_class=chat_tokenizer())  # its tool needs a template that renders tools
    assert trainer.reward_func_names == ["Scored"] and [t.__name__ for t in trainer.tools] == ["hint"]
    trainer.train()
    assert trainer.state.log_history[0]["rewards/Scored/mean"] == 1.0
    with pytest.raises(ConfigError, match="max_steps must be set"):
        GRPOTrainer(tiny_model_dir, spy, args=_config(tmp_path, max_steps=-1, num_train_epochs=1),
                    environment_factory=Owner)
    with pytest.raises(ConfigError, match="requires a `train_dataset`"):
        GRPOTrainer(tiny_model_dir, spy, args=args, environment_factory={"a": Owner})
