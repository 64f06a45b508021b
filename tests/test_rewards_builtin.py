"""Built-in rewards with hand-worked values, the reward model, the HTTP reward and the code-execution reward."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time

import pytest
import torch

from grpokit.rewards import (
    CodeExecutionReward,
    ExactMatchReward,
    HTTPRewardFunction,
    LengthPenalty,
    MathAccuracyReward,
    RegexFormatReward,
    RepetitionPenalty,
    RewardError,
    RewardModelFunction,
    SandboxConfig,
    SoftOverlongPunishment,
    TagStructureReward,
    parse_test_cases,
    resolve_reward_funcs,
    score_completions,
    soft_overlong_punishment,
)
from grpokit.rewards.text import completion_text, extract_code_block, extract_tag

GOOD_R1 = "<think>\n2+2 is 4\n</think>\n<answer>4</answer>"


def chat(text):
    return [{"role": "assistant", "content": text}]


# --- text helpers --------------------------------------------------------------------------------------------


def test_completion_text_handles_both_forms_and_content_parts():
    assert completion_text("plain") == "plain"
    assert completion_text(chat("hi")) == "hi"
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]
    assert completion_text([{"role": "assistant", "content": parts}]) == "ab"
    assert completion_text(chat("x") + chat("y")) == "x\ny"


def test_extract_tag_takes_the_last_pair_and_code_block_skips_other_languages():
    assert extract_tag("<answer>1</answer> then <answer> 2 </answer>", "answer") == "2"
    assert extract_tag("<answer>open", "answer") is None
    text = "```cpp\nint x;\n```\nprose\n```python\nprint(1)\n```\n```py\nprint(2)\n```"
    assert extract_code_block(text) == "print(2)\n"
    assert extract_code_block("```cpp\nint x;\n```\nno python here") is None
    assert extract_code_block("```\nx = 1\n```") == "x = 1\n"


# --- format, tags, repetition --------------------------------------------------------------------------------


def test_regex_format_full_match_and_malformed_penalty():
    reward = RegexFormatReward()
    completions = [GOOD_R1, "  " + GOOD_R1 + "\n", GOOD_R1 + " extra", "<answer>4</answer>", chat(GOOD_R1)]
    assert reward(completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert RegexFormatReward(malformed_reward=-1.0)(["nope", GOOD_R1]) == [-1.0, 1.0]
    assert RegexFormatReward(pattern=r"\d+")(["123", "12a"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RegexFormatReward(pattern="(")


def test_tag_structure_partial_credit_and_trailing_charge():
    reward = TagStructureReward()
    assert reward([GOOD_R1]) == [1.0]
    assert reward(["<think>a</think>"]) == [0.5]  # 2 of 4 tags exactly once; last tag absent -> no trailing charge
    assert reward(["<think><think>a</think><answer>4</answer>"]) == [0.75]  # <think> twice earns nothing
    assert reward([GOOD_R1 + "  tail12345 "]) == pytest.approx([1.0 - 0.001 * 9])
    assert TagStructureReward(tags=("<a>", "</a>"), trailing_penalty=0.1)(["<a>x</a>yy"]) == pytest.approx([0.8])


def test_repetition_penalty_words_and_tokens():
    reward = RepetitionPenalty(n=2, max_penalty=-0.5)
    # "a b a b a": bigrams ab ba ab ba -> 2 distinct of 4 -> ratio 0.5 -> -0.25
    assert reward(["a b a b a", "a b c d", "a"]) == pytest.approx([-0.25, 0.0, 0.0])
    tokens = RepetitionPenalty(n=1, unit="tokens")
    assert tokens(["ignored"] * 2, completion_ids=[[1, 1, 1, 1], [1, 2, 3, 4]]) == pytest.approx([-0.75, 0.0])
    with pytest.raises(ValueError, match="max_penalty must be <= 0"):
        RepetitionPenalty(max_penalty=1.0)


# --- length ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0), (101, -1.0), (500, -1.0)],
)
def test_soft_overlong_punishment_matches_dapo_piecewise_formula(length, expected):
    # L_max = 100, L_cache = 20: free up to 80 tokens, then (80 - L) / 20, and -1 past 100.
    assert soft_overlong_punishment(length, 100, 20) == pytest.approx(expected)
    assert SoftOverlongPunishment(100, 20)(completion_ids=[[0] * length]) == pytest.approx([expected])


def test_soft_overlong_default_cache_is_a_fifth_and_bad_values_are_rejected():
    assert SoftOverlongPunishment(100).cache_length == 20
    with pytest.raises(ValueError, match="cache_length must be in"):
        SoftOverlongPunishment(100, 0)
    with pytest.raises(ValueError, match="max_completion_length must be a positive int"):
        SoftOverlongPunishment(0)


def test_length_penalty_is_linear_past_the_target_and_capped():
    reward = LengthPenalty(max_completion_length=110, target_length=10, coef=0.5)
    ids = [[0] * n for n in (0, 10, 60, 110, 200)]
    assert reward(completion_ids=ids) == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    assert LengthPenalty(4)(completion_ids=[[1], [1, 2, 3, 4]]) == pytest.approx([-0.25, -1.0])
    with pytest.raises(ValueError, match="target_length must be in"):
        LengthPenalty(10, target_length=10)


# --- answers -------------------------------------------------------------------------------------------------


def test_exact_match_uses_answer_tag_normalises_and_skips_missing_gold():
    reward = ExactMatchReward()
    completions = ["<answer> Paris </answer>", "paris", "<answer>Lyon</answer>", chat("<answer>PARIS</answer>"), "x"]
    assert reward(completions, answer=["paris", "Paris", "Paris", "Paris", None]) == [1.0, 1.0, 0.0, 1.0, None]
    assert ExactMatchReward(case_sensitive=True)(["paris"], answer=["Paris"]) == [0.0]
    with pytest.raises(ValueError, match=r"needs a gold-answer column named one of \['answer'\].*\['label'\]"):
        reward(["a"], label=["a"], prompts=["p"])


def test_math_accuracy_verifies_equivalence_and_gives_none_for_unparseable_gold():
    reward = MathAccuracyReward()
    completions = [
        "so the result is \\boxed{\\frac{1}{2}}",
        "<think>...</think><answer>0.5</answer>",
        "<answer>3</answer>",
        "the answer is 7",
        "<answer>x^2 + 1</answer>",
        "<answer>1</answer>",
        "<answer>1</answer>",
    ]
    solutions = ["$\\frac{1}{2}$", "\\frac{1}{2}", "4", "no math here", "1 + x^2", "\\frac{", None]
    assert reward(completions, solution=solutions) == [1.0, 1.0, 0.0, None, 1.0, None, None]
    assert reward(["42"], answer=["42"]) == [1.0]  # falls back to the `answer` column


def test_math_accuracy_works_off_the_main_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(MathAccuracyReward()(["\\boxed{2}"], answer=["2"])))
    thread.start()
    thread.join()
    assert out == [[1.0]]


def test_math_accuracy_without_math_verify_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install grpokit\[math\]"):
        MathAccuracyReward()
    with pytest.raises(RewardError, match=r"pip install grpokit\[math\]"):
        resolve_reward_funcs(["math_accuracy"])


# --- reward model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from grpokit.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _reference_scores(path, texts):
    """One unpadded forward pass per text, one token per character (the tokenizer as saved: AutoTokenizer would
    swap in Qwen2's own class for this model type, which drops characters): the score the batched path must
    reproduce."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    encoded = [tokenizer(t, return_tensors="pt") for t in texts]
    assert [e["input_ids"].shape[1] for e in encoded] == [len(t) for t in texts]
    with torch.no_grad():
        return [model(**e).logits[0, 0].item() for e in encoded]


def test_reward_model_scores_prompt_plus_completion_batched_and_padded(reward_model_dir):
    prompts = ["1+1=", "Say hi: ", "abc"]
    completions = ["2", "hello there, friend", "defghij"]
    reference = _reference_scores(reward_model_dir, [p + c for p, c in zip(prompts, completions)])
    for batch_size in (1, 2, 3):
        scores = RewardModelFunction(reward_model_dir, batch_size=batch_size, device="cpu")(prompts, completions)
        assert scores == pytest.approx(reference, abs=1e-5)
    assert len(set(round(s, 4) for s in reference)) == 3  # the texts really get different scores


def test_reward_model_applies_the_chat_template_to_conversations(reward_model_dir):
    rm = RewardModelFunction(reward_model_dir, device="cpu")
    prompts = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "hi"}]]
    completions = [chat("4"), chat("hello")]
    assert rm.texts(prompts, completions) == ["user: 2+2?\nassistant: 4\n", "user: hi\nassistant: hello\n"]
    reference = _reference_scores(reward_model_dir, rm.texts(prompts, completions))
    assert rm(prompts, completions) == pytest.approx(reference, abs=1e-5)


def test_reward_model_through_the_contract(reward_model_dir):
    funcs = resolve_reward_funcs([reward_model_dir], reward_model_kwargs={"device": "cpu"})
    result = score_completions(funcs, ["a", "b"], ["x", "y"], [[1], [2]], {}, None)
    assert [f.name for f in funcs] == ["tiny-rm"] and result.rewards.shape == (2, 1)
    assert result.rewards[:, 0].tolist() == pytest.approx(_reference_scores(reward_model_dir, ["ax", "by"]), abs=1e-5)


# --- HTTP reward ---------------------------------------------------------------------------------------------------


class RewardServer:
    """A real HTTP server on 127.0.0.1 whose behaviour per request is scripted by `responses`."""

    def __init__(self, responses):
        self.responses = list(responses)
        self.requests = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                status, payload, delay = owner.responses.pop(0) if owner.responses else (200, [], 0)
                time.sleep(delay)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_http_reward_posts_prompts_completions_and_columns():
    with RewardServer([(200, [1.0, None], 0)]) as server:
        funcs = resolve_reward_funcs([server.url])
        result = score_completions(funcs, ["p0", "p1"], ["c0", "c1"], [[1], [2]], {"answer": ["a", "b"]}, object())
    assert server.requests == [{"prompts": ["p0", "p1"], "completions": ["c0", "c1"], "answer": ["a", "b"]}]
    assert [f.name for f in funcs] == ["127.0.0.1"]
    assert result.rewards[0, 0] == 1.0 and torch.isnan(result.rewards[1, 0])


def test_http_reward_accepts_a_rewards_object_and_retries_a_flaky_server():
    with RewardServer([(503, {"error": "busy"}, 0), (200, {"rewards": [0.5, 2]}, 0)]) as server:
        reward = HTTPRewardFunction(server.url, retries=2, backoff=0.01)
        assert reward(prompts=["a", "b"], completions=["x", "y"]) == [0.5, 2]
    assert len(server.requests) == 2


def test_http_reward_timeout_fails_clearly_after_the_last_retry():
    with RewardServer([(200, [1.0], 1.0), (200, [1.0], 1.0)]) as server:
        reward = HTTPRewardFunction(server.url, timeout=0.2, retries=1, backoff=0.0)
        start = time.monotonic()
        expected = r"failed after 2 attempt\(s\).*timed out.*raise timeout \(now 0.2s\)"
        with pytest.raises(ConnectionError, match=expected):
            reward(prompts=["a"], completions=["x"])
        assert time.monotonic() - start < 1.5
        assert len(server.requests) == 2


def test_http_reward_client_error_is_not_retried_and_connection_refused_is():
    with RewardServer([(400, {"error": "bad field"}, 0)]) as server:
        with pytest.raises(ConnectionError, match="HTTP 400 Bad Request.*bad field"):
            HTTPRewardFunction(server.url, retries=3, backoff=0.0)(prompts=["a"], completions=["x"])
        assert len(server.requests) == 1
        url = server.url
    with pytest.raises(ConnectionError, match=r"failed after 3 attempt\(s\): URLError"):
        HTTPRewardFunction(url, retries=2, backoff=0.0)(prompts=["a"], completions=["x"])


def test_http_reward_wrong_answer_shape_is_reported_through_the_contract():
    with RewardServer([(200, {"scores": [1]}, 0), (200, [1.0, 2.0, 3.0], 0)]) as server:
        funcs = resolve_reward_funcs([server.url])
        with pytest.raises(RewardError, match=r"must answer a JSON list of numbers/null or \{\"rewards\""):
            score_completions(funcs, ["a"], ["x"], [[1]], {}, None)
        with pytest.raises(RewardError, match="returned 3 values for a batch of 1 completions"):
            score_completions(funcs, ["a"], ["x"], [[1]], {}, None)


# --- code execution ------------------------------------------------------------------------------------------------

FAST = SandboxConfig(timeout_seconds=3, cpu_seconds=2)
ADD = "```python\ndef add(a, b):\n    return a + b\n```"


def test_parse_test_cases_reads_every_documented_form():
    asserts = parse_test_cases(["assert f(1) == 1", "assert f(2) == 2"])
    assert [t.snippet for t in asserts] == ["assert f(1) == 1", "assert f(2) == 2"]
    pairs = parse_test_cases([{"input": "1\n", "output": "2\n"}])
    assert (pairs[0].stdin, pairs[0].expected_stdout, pairs[0].snippet) == ("1\n", "2\n", None)
    apps = parse_test_cases('{"inputs": ["1", "2"], "outputs": ["2", "4"]}')
    assert [(t.stdin, t.expected_stdout) for t in apps] == [("1", "2"), ("2", "4")]
    assert [t.snippet for t in parse_test_cases("assert True")] == ["assert True"]
    assert parse_test_cases(None) == [] and parse_test_cases("  ") == []
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_test_cases({"inputs": ["1", "2"], "outputs": ["2"]})


def test_code_execution_scores_the_fraction_of_asserts_passed():
    reward = CodeExecutionReward(FAST)
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4", "assert add(5, 0) == 5"]
    scores = reward([ADD, wrong, "no code at all", chat(ADD)], test_cases=[tests] * 4)
    assert scores == [1.0, 0.5, 0.0, 1.0]


def test_code_execution_stdin_stdout_tests_and_the_tests_column():
    reward = CodeExecutionReward(FAST)
    double = "```python\nn = int(input())\nprint(n * 2)   \n```"
    cases = {"inputs": ["1\n", "5\n", "7\n"], "outputs": ["2\n", "10", "15\n"]}
    assert reward([double], tests=[cases]) == [pytest.approx(2 / 3)]


def test_code_execution_early_exit_does_not_pass_and_missing_tests_are_none():
    reward = CodeExecutionReward(FAST)
    cheat = "```python\nimport os\nos._exit(0)\n```"
    cheat2 = "```python\nimport sys\nsys.exit(0)\n```"
    scores = reward([cheat, cheat2, ADD], test_cases=[["assert add(1, 1) == 2"], ["assert add(1, 1) == 2"], None])
    assert scores == [0.0, 0.0, None]
    with pytest.raises(ValueError, match=r"needs a test-case column named one of \['test_cases', 'tests'\]"):
        reward([ADD], answer=["x"])


def test_code_execution_through_resolve_with_dict_config():
    funcs = resolve_reward_funcs([{"name": "code_execution", "config": {"timeout_seconds": 2}}])
    assert funcs[0].fn.sandbox.config.timeout_seconds == 2
    result = score_completions(funcs, ["p"], [ADD], [[1]], {"test_cases": [["assert add(2, 3) == 5"]]}, None)
    assert result.rewards.tolist() == [[1.0]]
