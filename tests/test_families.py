"""The model families users have, with their stock chat templates: tokenizers built here with each family's
special tokens and its stock template (TRL's copies in trl/chat_templates, read from the installed trl, the dev
extra), tiny random models, and a scripted rollout engine that writes each family's tool calls.

Per family: which template renders the episode tokens (the stock one, or grpokit's training version, with a
warning); the training version renders prompts as the stock one does; the tool-call format "auto" picks; the
episode transcript equals what the stock template renders for the finished conversation (where the family's
template allows); and GRPOTrainer trains with tools and with an environment, the calls parsed and run."""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rollout import register_rollout_engine
from grpokit.rollout.engine import SamplingParams, pad_rollout
from grpokit.rollout.multiturn import TURN_STRIDE, ChatRenderer, MultiTurn
from grpokit.tiny import char_tokenizer, tiny_qwen2
from grpokit.tools import Toolbox, bind_format, resolve_format


@dataclass(frozen=True)
class Family:
    """A model family's tokenizer: its stock template (a file of trl/chat_templates), special tokens (never
    split, skipped when decoding), added tokens (never split, kept), EOS, pad, BOS, the generation config's stop
    tokens, what grpokit does with its template, the format "auto" picks, and scripted turns in the template's
    own rendering (a call, then a final answer)."""

    template: str
    special: tuple[str, ...]
    eos: str
    pad: str
    stops: tuple[str, ...]
    training_template: str | None
    call_format: str
    call: str
    answer: str
    added: tuple[str, ...] = ()
    bos: str | None = None


QWEN_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call><|im_end|>'
QWEN_XML_CALL = ("<tool_call>\n<function=add>\n<parameter=a>\n20\n</parameter>\n<parameter=b>\n22\n</parameter>\n"
                 "</function>\n</tool_call><|im_end|>")
LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>")
LLAMA = dict(special=LLAMA_SPECIAL, eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
             stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), training_template=None, call_format="llama3",
             call='{"name": "add", "parameters": {"a": 20, "b": 22}}<|eot_id|>', answer="It is 42.<|eot_id|>")
FAMILIES = {
    "qwen2_5": Family("qwen2_5.jinja", QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"),
                      None, "qwen", QWEN_CALL, "It is 42.<|im_end|>", QWEN_ADDED),
    "qwen3": Family("qwen3.jinja", QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"),
                    "qwen3", "qwen", "<think>\nI add.\n</think>\n\n" + QWEN_CALL,
                    "<think>\nDone.\n</think>\n\nIt is 42.<|im_end|>", QWEN_ADDED),
    "qwen3_instruct_2507": Family("qwen3_instruct_2507.jinja", QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>",
                                  ("<|im_end|>", "<|endoftext|>"), None, "qwen", QWEN_CALL, "It is 42.<|im_end|>",
                                  QWEN_ADDED),
    "qwen3_5": Family("qwen3_5_think.jinja", QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>",
                      ("<|im_end|>", "<|endoftext|>"), "qwen3", "qwen3_xml", "I add.\n</think>\n\n" + QWEN_XML_CALL,
                      "Done.\n</think>\n\nIt is 42.<|im_end|>", QWEN_ADDED),
    "qwen3_6": Family("qwen3_6.jinja", QWEN_SPECIAL, "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"),
                      "qwen3", "qwen3_xml", "I add.\n</think>\n\n" + QWEN_XML_CALL,
                      "Done.\n</think>\n\nIt is 42.<|im_end|>", QWEN_ADDED),
    "llama3_1": Family("llama3_1.jinja", **LLAMA),
    "llama3_2": Family("llama3_2.jinja", **LLAMA),
    "gptoss": Family("gptoss.jinja", ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                      "<|return|>", "<|call|>", "<|endoftext|>"),
                     "<|return|>", "<|endoftext|>", ("<|return|>", "<|endoftext|>", "<|call|>"), "gpt-oss", "harmony",
                     ' to=functions.add<|channel|>commentary json<|message|>{"a": 20, "b": 22}<|call|>',
                     "<|channel|>final<|message|>It is 42.<|return|>"),
}


def stock_template(name: str) -> str:
    trl = pytest.importorskip("trl", minversion="1.16")
    return (Path(trl.__file__).parent / "chat_templates" / name).read_text(encoding="utf-8")


def family_tokenizer(name: str):
    """A character-level tokenizer with the family's special tokens and stock chat template."""
    family = FAMILIES[name]
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(family.special)})
    tok.add_tokens(list(family.added))
    tok.eos_token, tok.pad_token = family.eos, family.pad
    if family.bos:
        tok.bos_token = family.bos
    tok.chat_template = stock_template(family.template)
    return tok


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


TOOLS = Toolbox([add]).schemas
PROMPT = [{"role": "user", "content": "What is 20+22?"}]


def render(tok, messages, generation_prompt=False, **kwargs):
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=False,
                                   **kwargs)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- templates
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_stock_template_or_grpokits_training_version_renders_episodes_with_one_warning(name, caplog):
    tok = family_tokenizer(name)
    with caplog.at_level(logging.WARNING, logger="grpokit.rollout.multiturn"):
        renderer = ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS})
    assert renderer.training_template == FAMILIES[name].training_template
    warnings = [r for r in caplog.records if "training version" in r.getMessage()]
    assert len(warnings) == (renderer.training_template is not None)
    assert renderer.kwargs.get("chat_template") is None or renderer.training_template is not None
    assert tok.chat_template == stock_template(FAMILIES[name].template)  # the tokenizer itself is untouched


PROMPTS = {
    "user": PROMPT,
    "system": [{"role": "system", "content": "Be brief."}] + PROMPT,
    "history": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}] + PROMPT,
    "tool history": PROMPT + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 20, "b": 22}}}]},
        {"role": "tool", "name": "add", "content": "42"}],
}


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.training_template))
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("with_tools", [True, False])
def test_the_training_version_renders_every_prompt_as_the_stock_template(name, prompt, with_tools):
    tok = family_tokenizer(name)
    training = ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS}).kwargs["chat_template"]
    kwargs = {"tools": TOOLS if with_tools else None}
    stock = tok.apply_chat_template(PROMPTS[prompt], add_generation_prompt=True, tokenize=False, **kwargs)
    if prompt == "tool history" and name in ("qwen3_5", "qwen3_6"):  # documented: a call after the last user
        stock = stock.replace("<think>\n\n</think>\n\n<tool_call>", "<tool_call>")  # message, without reasoning
    assert tok.apply_chat_template(PROMPTS[prompt], add_generation_prompt=True, tokenize=False,
                                   chat_template=training, **kwargs) == stock


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_auto_reads_calls_in_the_format_the_family_template_writes(name):
    tok = family_tokenizer(name)
    detected = bind_format(resolve_format("auto"), tok, {"tools": TOOLS})
    assert detected.name == FAMILIES[name].call_format


# ---------------------------------------------------------------- episodes: the transcript is the stock rendering
class Scripted:
    """Turn k of every row is script[k] (the last entry repeats), tokenised as the model would write it; a turn
    ends at the family's first stop token."""

    def __init__(self, tok, name, script):
        self.tok, self.script = tok, script
        self.stops = [tok.convert_tokens_to_ids(s) for s in FAMILIES[name].stops]

    def __call__(self, prompt_ids, sample_ids, params):
        turns = [self.script[min(sid // TURN_STRIDE, len(self.script) - 1)] for sid in sample_ids.tolist()]
        tokens = [ids(self.tok, text)[: params.max_completion_length] for text in turns]
        return pad_rollout(tokens, None, self.stops, self.tok.pad_token_id)


def run_episode(name, script, environment=None, tools=(add,)):
    tok = family_tokenizer(name)
    kwargs = {"tools": Toolbox(list(tools) + ([environment.add] if environment else [])).schemas}
    runner = MultiTurn(tok, Toolbox(list(tools)), resolve_format("auto"), [tok.eos_token_id], True, 4, kwargs)
    generate = Scripted(tok, name, script)
    prompt_ids = ids(tok, tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False, **kwargs))
    episodes = runner.run(generate, [prompt_ids], torch.arange(1), SamplingParams(1000),
                          [environment] if environment else None)
    rollout = episodes.rollout
    transcript = tok.decode(prompt_ids + rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist())
    return tok, episodes, transcript, kwargs


def stock_rendering(tok, episodes, kwargs):
    """What the stock template renders for the finished conversation (no trailing newline)."""
    return tok.apply_chat_template(PROMPT + episodes.completions[0], tokenize=False, **kwargs).rstrip("\n")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_tool_episode_is_what_the_stock_template_renders_for_the_finished_conversation(name):
    family = FAMILIES[name]
    tok, episodes, transcript, kwargs = run_episode(name, [family.call, family.answer])
    assert episodes.tool_calls == [1] and episodes.tool_failures == [0] and episodes.turns == [2]
    assert episodes.completions[0][1] == {"role": "tool", "name": "add", "content": "42"}
    assert transcript == stock_rendering(tok, episodes, kwargs)


class Checker:
    """An environment whose tool adds, and which asks once whether the final answer is sure."""

    def reset(self, **row):
        self.calls, self.answers = [], []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls.append((a, b))
        return a + b

    def respond(self, text):
        self.answers.append(text)
        return "Are you sure?" if len(self.answers) == 1 else None

    def get_reward(self):
        return float(bool(self.calls))


def without_earlier_thinking(transcript):
    """Qwen3.5 / 3.6 re-render the turns before the last user message without their think blocks."""
    head, user, tail = transcript.rpartition("<|im_start|>user\n")
    return re.sub(r"<think>\n.*?</think>\n\n", "", head, flags=re.DOTALL) + user + tail


# what the stock templates re-render once a user message follows an answer: GPT-OSS writes <|end|> where the
# model wrote <|return|>; Qwen3.5 / 3.6 drop earlier think blocks (their generation prompt opens one); Qwen3 drops
# the reasoning of earlier turns too (the script writes none there)
ENVIRONMENT_DIFFERENCES = {
    "gptoss": lambda transcript: transcript.replace("<|return|><|start|>user", "<|end|><|start|>user"),
    "qwen3_5": without_earlier_thinking,
    "qwen3_6": without_earlier_thinking,
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_environment_episode_is_the_stock_rendering_up_to_what_the_family_re_renders(name):
    family = FAMILIES[name]
    answer = family.answer.replace("<think>\nDone.\n</think>\n\n", "")  # Qwen3 drops earlier turns' reasoning
    env = Checker()
    env.reset()
    call = family.call.replace("<think>\nI add.\n</think>\n\n", "")
    tok, episodes, transcript, kwargs = run_episode(name, [call, answer, family.answer], env, tools=())
    assert env.calls == [(20, 22)] and [a.endswith("It is 42.") for a in env.answers] == [True, True]
    assert [m["role"] for m in episodes.completions[0]] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert ENVIRONMENT_DIFFERENCES.get(name, lambda text: text)(transcript) == stock_rendering(tok, episodes, kwargs)


# ---------------------------------------------------------------- training through GRPOTrainer
# the calls as the models write them: Llama after <|python_tag|>, ending with <|eom_id|>; GPT-OSS with its
# analysis first and the recipient after the channel
MODEL_CALLS = {
    "llama3_1": '<|python_tag|>{"name": "add", "parameters": {"a": 20, "b": 22}}<|eom_id|>',
    "gptoss": '<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary '
              'to=functions.add <|constrain|>json<|message|>{"a":20,"b":22}<|call|>',
}
TRAINED = ["qwen3", "llama3_1", "llama3_2", "gptoss"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """name -> a saved tiny model and its family tokenizer (stops in the generation config, as the real ones)."""
    out = {}
    for name in TRAINED:
        tok = family_tokenizer(name)
        model = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=4096,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(s) for s in FAMILIES[name].stops]
        path = tmp_path_factory.mktemp(f"family-{name}")
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = str(path)
    return out


class ScriptedEngine:
    """A rollout engine that writes the script (turn k of a completion: script[k]) whatever the weights."""

    name = "scripted"

    def __init__(self, context, script):
        self.context, self.script = context, script

    def generate(self, request):
        tok = self.context.tokenizer
        texts = [self.script[min(sid // TURN_STRIDE, len(self.script) - 1)] for sid in request.sample_ids.tolist()]
        tokens = [ids(tok, text)[: request.params.max_completion_length] for text in texts]
        return pad_rollout(tokens, None, self.context.eos_token_ids, self.context.pad_token_id)

    def sync_weights(self, weights, version):
        pass

    def close(self):
        pass


def answered(completions, **kwargs):
    return [float("42" in c[-1]["content"]) for c in completions]


@pytest.mark.parametrize("name", TRAINED)
@pytest.mark.parametrize("mode", ["tools", "environment"])
def test_grpo_trainer_trains_each_family_with_tools_and_with_an_environment(name, mode, family_dirs, tmp_path):
    family = FAMILIES[name]
    call = MODEL_CALLS.get(name, family.call)
    engine = f"test_family_{name}_{mode}"
    register_rollout_engine(engine)(lambda context: ScriptedEngine(context, [call, family.answer]))
    ran = tmp_path / "calls.txt"  # a file: standalone tools run in a worker process, whose memory is its own

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        with open(ran, "a") as fh:
            fh.write(f"{a},{b}\n")
        return a + b

    class Adder(Checker):
        def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            return add(a, b)

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_prompt_length=2048, max_completion_length=500, learning_rate=1e-3, beta=0.0, logging_steps=1,
                      save_strategy="no", report_to=[], rollout_engine=engine, tool_call_format="auto",
                      max_tool_calling_iterations=3)
    dataset = datasets.Dataset.from_list([{"prompt": PROMPT}, {"prompt": [{"role": "user", "content": "20+22?"}]}])
    extra = {"tools": [add]} if mode == "tools" else {"environment_factory": Adder}
    trainer = GRPOTrainer(family_dirs[name], answered, args=args, train_dataset=dataset, **extra)
    trainer.train()
    assert ran.read_text().splitlines() == ["20,22"] * 4  # every episode's call was parsed and run
    row = trainer.state.log_history[0]
    assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
    assert row["rewards/answered/mean"] == 1.0
    assert trainer.tokenizer.chat_template == stock_template(family.template)


CLI_MODULE = '''
import json, os
from grpokit.rollout.engine import pad_rollout
from grpokit.rollout.multiturn import TURN_STRIDE

SCRIPT = {script!r}
RAN = os.path.join(os.path.dirname(__file__), "ran.jsonl")


class Scripted:
    """Writes the script's turn k for a completion's turn k, whatever the weights."""

    def __init__(self, context):
        self.context = context

    def generate(self, request):
        tok = self.context.tokenizer
        texts = [SCRIPT[min(sid // TURN_STRIDE, len(SCRIPT) - 1)] for sid in request.sample_ids.tolist()]
        tokens = [tok(t, add_special_tokens=False)["input_ids"][: request.params.max_completion_length] for t in texts]
        return pad_rollout(tokens, None, self.context.eos_token_ids, self.context.pad_token_id)

    def sync_weights(self, weights, version):
        pass

    def close(self):
        pass


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    with open(RAN, "a") as f:
        f.write(json.dumps([a, b]) + "\\n")
    return a + b


class Adder:
    def reset(self, **row):
        pass

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return add(a, b)


def answered(completions, **kwargs):
    return [float("42" in c[-1]["content"]) for c in completions]
'''


@pytest.mark.parametrize("name", TRAINED)
@pytest.mark.parametrize("mode", ["tools", "environment"])
def test_grpo_train_trains_each_family_from_yaml(name, mode, family_dirs, tmp_path, monkeypatch, capsys):
    """`grpo train run.yaml` with the family's stock tokenizer, tools or an environment named by import path, the
    call format left at its default ("auto")."""
    import json

    import yaml

    from grpokit.cli import main

    family = FAMILIES[name]
    module = f"family_cli_{name}_{mode}"
    script = [MODEL_CALLS.get(name, family.call), family.answer]
    (tmp_path / f"{module}.py").write_text(CLI_MODULE.format(script=script))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"What is 20+22? ({i})"}]}) + "\n" for i in range(2)))
    run = {"model": family_dirs[name], "dataset": str(tmp_path / "prompts.jsonl"), "reward_funcs": [f"{module}:answered"],
           "output_dir": str(tmp_path / "out"), "max_steps": 1, "num_generations": 2, "per_device_train_batch_size": 4,
           "max_prompt_length": 2048, "max_completion_length": 500, "beta": 0.0, "save_strategy": "no",
           "rollout_engine": f"{module}:Scripted", "max_tool_calling_iterations": 3, "disable_tqdm": True,
           **({"tools": [f"{module}:add"]} if mode == "tools" else {"environment_factory": f"{module}:Adder"})}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err[-3000:]
    err = capsys.readouterr().err
    assert ("training version" in err) == (family.training_template is not None)  # said once, on stderr
    assert (tmp_path / "ran.jsonl").read_text().splitlines() == ["[20, 22]"] * 4  # every call parsed and run
    row = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][0]
    assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
    assert row["rewards/answered/mean"] == 1.0
