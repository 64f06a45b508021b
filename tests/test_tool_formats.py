"""Tool-call formats against real renderings: each family's stock chat template writes calls, the family's format
reads them back; the forms the models write (Llama's <|python_tag|>, GPT-OSS's analysis and <|constrain|>); every
malformed call is an {"error": ...} the model reads; plain-text results equal what the chat template appends;
the tokenizer's own response parser ("schema"); "auto"'s fallbacks; templates grpokit cannot fix."""

import json
import logging

import pytest

from grpokit.rollout.multiturn import ChatRenderer, MultiTurnError
from grpokit.tiny import CHAT_TEMPLATE, char_tokenizer
from grpokit.tools import TOOL_CALL_FORMATS, ToolCall, ToolResult, Toolbox, bind_format, resolve_format
from grpokit.tools.schema import response_parsing
from grpokit.tools.toolbox import tool_schema, typed_arguments
from test_families import FAMILIES, TOOLS, add, family_tokenizer, run_episode, stock_template

ARGUMENTS = {"city": "Paris", "days": 3, "units": {"temp": "C"}, "flags": [True, None], "note": 'say "hi"; bye'}
CALL = {"type": "function", "function": {"name": "weather", "arguments": ARGUMENTS}}
PROMPT = [{"role": "user", "content": "Weather?"}]


def written_turn(tok, calls):
    """The assistant turn the stock template renders for these calls, after the generation prompt and without
    the end-of-turn token: what a model trained on the template writes."""
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(PROMPT + [{"role": "assistant", "content": "", "tool_calls": calls}],
                                   tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt):].rstrip().removesuffix(tok.eos_token)


def weather(city: str, days: int, units: dict, flags: list, note: str) -> str:
    """Forecast.

    Args:
        city: The city.
        days: How many days.
        units: Units per quantity.
        flags: Options.
        note: A note.
    """
    return city


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_format_reads_the_call_its_stock_template_writes(name):
    tok = family_tokenizer(name)
    [call] = resolve_format(FAMILIES[name].call_format).parse(written_turn(tok, [CALL]))
    if not call.typed:  # text values (qwen3_xml): what the toolbox passes the function
        call = ToolCall(call.name, typed_arguments(call.arguments, tool_schema(weather)))
    assert call == ToolCall("weather", ARGUMENTS)


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "qwen3_instruct_2507"])
def test_qwen_templates_write_several_calls_per_turn_and_all_are_read(name):
    tok = family_tokenizer(name)
    second = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    assert resolve_format("qwen").parse(written_turn(tok, [CALL, second])) == [
        ToolCall("weather", ARGUMENTS), ToolCall("add", {"a": 1, "b": 2})]


def test_llama3_reads_python_tag_calls_several_calls_and_leaves_answers_alone():
    llama = resolve_format("llama3")
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert llama.parse(f"<|python_tag|>{call}<|eom_id|>") == [ToolCall("add", {"a": 1, "b": 2})]
    assert llama.parse(f"  {call}\n") == [ToolCall("add", {"a": 1, "b": 2})]
    assert llama.parse('{"name": "add", "arguments": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}') == [
        ToolCall("add", {"a": 1}), ToolCall("add", {"b": 2})]
    assert llama.parse("The sum is 3.") == []
    assert llama.parse('Here: {"name": "add", "parameters": {}}') == []  # prose first: an answer, not a call
    assert llama.parse('{"answer": 3}') == []


def test_harmony_reads_the_model_form_and_the_template_form_and_splits_channels():
    harmony = resolve_format("harmony")
    model_form = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                  'to=functions.weather <|constrain|>json<|message|>' + json.dumps(ARGUMENTS) + "<|call|>")
    assert harmony.parse(model_form) == [ToolCall("weather", ARGUMENTS)]
    assert harmony.message(model_form) == {"content": "", "thinking": "Need the weather."}
    template_form = " to=functions.weather<|channel|>commentary json<|message|>" + json.dumps(ARGUMENTS)
    assert harmony.parse(template_form) == [ToolCall("weather", ARGUMENTS)]
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    assert harmony.parse(answer) == []
    assert harmony.message(answer) == {"content": "Sunny.", "thinking": "Easy."}
    assert harmony.message("no structure <|end|>") == {"content": "no structure"}
    # a tool message the model wrote in the tool's name is not a call of the model's
    assert harmony.parse('<|start|>functions.add to=assistant<|channel|>commentary<|message|>"3"<|end|>') == []


MALFORMED = {
    "qwen3_xml": ["<tool_call>\n<function>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                  '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'],
    "qwen": ['<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', '<tool_call>{"a": 1}</tool_call>'],
    "llama3": ['{"name": "add", "parameters": {"a": 1,}}', "<|python_tag|>print(1)", '{"name": 3}',
               '{"name": "add", "parameters": [1, 2]}'],
    "harmony": ["<|channel|>commentary to=functions.add <|constrain|>json<|message|>{a: 1}<|call|>",
                '<|channel|>commentary to=browser.search json<|message|>{"q": 1}<|call|>',
                "<|channel|>commentary to=functions.add json<|message|>[1, 2]<|call|>"],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_a_malformed_call_is_an_error_message_the_model_reads(name, text):
    calls = resolve_format(name).parse(text)
    assert len(calls) == 1 and calls[0].error
    [result] = Toolbox([add]).run(calls)
    assert result.failed and set(json.loads(result.content)) == {"error"}


def test_several_llama_calls_in_one_turn_all_run_though_its_template_renders_one_per_turn():
    two = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}<|eot_id|>'
    _, episodes, transcript, _ = run_episode("llama3_1", [two, "3 and 7.<|eot_id|>"])
    assert episodes.tool_calls == [2] and episodes.tool_failures == [0]
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"3"<|eot_id|><|start_header_id|>ipython<|end_header_id|>' \
           '\n\n"7"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3 and 7.<|eot_id|>' in transcript


def test_qwen3_xml_values_are_typed_by_the_tools_schema():
    def describe(city: str, days: int, detailed: bool, hours: list[int]) -> str:
        """Describe the weather.

        Args:
            city: The city.
            days: How many days.
            detailed: Whether to go into detail.
            hours: Which hours.
        """
        return f"{city!r} {days!r} {detailed!r} {hours!r}"

    text = ("<tool_call>\n<function=describe>\n<parameter=city>\n75001\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n<parameter=hours>\n[6, 18]\n</parameter>\n"
            "</function>\n</tool_call>")
    [call] = resolve_format("qwen3_xml").parse(text)
    assert call == ToolCall("describe", {"city": "75001", "days": "3", "detailed": "True", "hours": "[6, 18]"},
                            typed=False)
    [result] = Toolbox([describe]).run([call])
    assert result.content == "'75001' 3 True [6, 18]"
    assert call.arguments["days"] == "3"  # the transcript keeps what the model wrote


@pytest.mark.parametrize("name", ["llama3_1", "llama3_2", "gptoss"])
def test_plain_text_results_are_what_the_chat_template_appends(name):
    tok = family_tokenizer(name)
    renderer = ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS})
    results = [ToolResult("add", "42")]
    format_ = resolve_format(FAMILIES[name].call_format)
    assert format_.render_results(results) == tok.decode(renderer.tool_suffix(results))


# ---------------------------------------------------------------- the tokenizer's own parser
def with_response_template(name, template):
    utils = pytest.importorskip("trl.chat_template_utils")
    tok = family_tokenizer(name)
    tok.response_template = getattr(utils, template)
    if response_parsing(tok) is None:
        pytest.skip("this transformers cannot read response templates (< 5.13)")
    return tok


@pytest.mark.parametrize("name,template", [("qwen3", "qwen3_template"), ("llama3_1", "llama3_template")])
def test_schema_reads_calls_with_the_tokenizers_response_template_and_auto_prefers_it(name, template):
    tok = with_response_template(name, template)
    schema = bind_format(resolve_format("auto"), tok, {"tools": TOOLS})
    assert schema.name == "schema"
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 20, "b": 22}}}
    assert schema.parse(written_turn(tok, [call])) == [ToolCall("add", {"a": 20, "b": 22})]
    assert schema.parse("It is 42.") == [] and schema.message("It is 42.")["content"] == "It is 42."


def test_schema_splits_reasoning_and_reports_an_unreadable_call():
    tok = with_response_template("qwen3", "qwen3_template")
    schema = bind_format(resolve_format("schema"), tok, {})
    message = schema.message("<think>\nHmm.\n</think>\n\nIt is 42.")
    assert message["content"] == "It is 42." and message["reasoning_content"] == "Hmm."
    calls = schema.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>')
    assert len(calls) == 1 and calls[0].error and "cannot be read" in calls[0].error


def test_schema_needs_a_response_template_this_transformers_reads(monkeypatch):
    tok = with_response_template("qwen3", "qwen3_template")
    monkeypatch.setattr("grpokit.tools.schema.transformers.__version__", "5.12.0")
    assert response_parsing(tok) is None
    with pytest.raises(ValueError, match=r"response_template \(transformers >= 5.13; installed 5.12.0\)"):
        bind_format(resolve_format("schema"), tok, {})
    assert bind_format(resolve_format("auto"), tok, {}).name == "qwen"  # auto falls back to the template's format


# ---------------------------------------------------------------- auto's fallbacks, registered formats
def test_auto_without_tool_rendering_is_qwen_and_warns_about_calls_no_format_reads(caplog):
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # renders no tool calls: plain-text prompts, grpokit's default format
    assert bind_format(resolve_format("auto"), tok, {}).name == "qwen"
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% for c in m.get('tool_calls') or [] %}[[{{ c['function']['name'] }} "
                         "{{ c['function']['arguments'] | tojson }}]]{% endfor %}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with caplog.at_level(logging.WARNING, logger="grpokit.tools.detect"):
        assert bind_format(resolve_format("auto"), tok, {}).name == "qwen"
    assert "no registered tool-call format reads" in caplog.text

    @TOOL_CALL_FORMATS.register("test_brackets")
    class Brackets:
        name = "test_brackets"

        def parse(self, text):
            head, _, arguments = text.strip().removeprefix("[[").removesuffix("]]").partition(" ")
            return [ToolCall(head, json.loads(arguments))] if arguments else []

        def render_results(self, results):
            return "".join(f"<<{r.content}>>" for r in results)

    assert bind_format(resolve_format("auto"), tok, {}).name == "test_brackets"  # a registered format is detected


# ---------------------------------------------------------------- templates grpokit cannot fix
def test_a_template_that_is_not_prefix_preserving_and_has_no_training_version_is_refused_with_the_fix():
    tok = family_tokenizer("qwen2_5")
    tok.chat_template = tok.chat_template.replace("'<|im_start|>' + message.role", "'<|im_start|>' + message.role + "
                                                  "(' (last)' if loop.last else '')")
    with pytest.raises(MultiTurnError, match="renders a conversation differently") as refusal:
        ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS})
    assert "training versions of these templates only: gpt-oss (GPT-OSS); qwen3" in str(refusal.value)
    assert "TRAINING_TEMPLATES" in str(refusal.value)


@pytest.mark.parametrize("template", ["qwen3_5_think.jinja", "qwen3_5_nothink.jinja", "qwen3_6.jinja"])
def test_the_qwen3_training_version_also_fixes_qwen3_5_and_3_6(template):
    tok = family_tokenizer("qwen3")
    tok.chat_template = stock_template(template)
    assert ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS}).training_template == "qwen3"
    qwen3_8 = stock_template("qwen3_8.jinja")  # prefix-preserving by default; not with preserve_thinking=False
    tok.chat_template = qwen3_8
    assert ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS}).training_template is None
    renderer = ChatRenderer(tok, [tok.eos_token_id], {"tools": TOOLS, "preserve_thinking": False})
    assert renderer.training_template == "qwen3"
    assert bind_format(resolve_format("auto"), tok, {"tools": TOOLS}).name == "qwen3_xml"
