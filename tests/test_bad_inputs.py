"""Bad inputs: each one gets an actionable error before the expensive work it would spoil, or a documented
warning and safe behaviour. docs/errors.md lists every case with its message and when it is raised.

"before model load" is pinned by making grpokit.train.learner.load_policy fail if called; "before generation" by
making generate_completions fail if called.
"""

import importlib.util
import json
import logging

import datasets
import pytest
import torch

import grpokit.train.learner as trainer_module
from grpokit.cli import main as grpo_main
from grpokit.config import ConfigError, GRPOConfig
from grpokit.data import DataError
from grpokit.models.loading import ModelError, load_tokenizer
from grpokit.rewards import RewardError
from grpokit.rollout.local import LocalEngine
from grpokit.trainer import GRPOTrainer
from helpers import frac_a, read_jsonl


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=4, learning_rate=1e-2, disable_tqdm=True, seed=0, logging_steps=1)
    values.update(overrides)
    return GRPOConfig(**values)


def rows(*prompts, **columns):
    return datasets.Dataset.from_list([{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)])


@pytest.fixture
def no_model_load(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the input error was reported")

    monkeypatch.setattr(trainer_module, "load_policy", forbidden)


@pytest.fixture
def no_generation(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("generation started before the input error was reported")

    monkeypatch.setattr(LocalEngine, "generate", forbidden)


# ---------------------------------------------------------------- options (GRPOConfig, before anything)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_generations": 1}, "needs at least 2 per prompt"),
        ({"per_device_train_batch_size": 6}, "not divisible by num_generations=4"),
        ({"loss_type": "ppo"}, "loss_type='ppo' is not valid; choose an aggregation (bnpo, dapo, dr_grpo, grpo, sequence_sum)"),
        ({"learning_rate": -1e-6}, "learning_rate=-1e-06 must be a finite number in [0, 1]"),
        ({"temperature": 0.0}, "for near-greedy sampling use a small value such as 0.1"),  # kept an error
        ({"max_completion_length": 0}, "max_completion_length=0 must be an integer in [1, 16777216]"),
    ],
    ids=["num_generations<2", "batch_not_divisible", "unknown_loss_type", "negative_lr", "temperature_0",
         "max_completion_length_0"],
)
def test_bad_options_fail_when_the_config_is_built(options, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        config(tmp_path, **options)
    assert message in str(err.value)


def test_report_to_not_installed_fails_when_the_config_is_built(tmp_path, monkeypatch):
    real = importlib.util.find_spec  # wandb is in the dev extra: make it look missing
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="^report_to includes 'wandb' but it is not installed: pip install wandb$"):
        config(tmp_path, report_to=["wandb"])


# ---------------------------------------------------------------- GRPOTrainer(...), before the model loads

TOO_LONG = "9" * 600  # the tiny model's context is 512 tokens (one token per character)


def _no_chat_template_tokenizer(model_dir):
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = None
    return tokenizer


CASES = {
    # id: (trainer keyword arguments, error type, text in the message)
    "no_prompt_column": (
        dict(train_dataset=datasets.Dataset.from_list([{"question": "1+1="}])), DataError,
        "has no 'prompt' column (columns: ['question']); rename yours with dataset.rename_column('question', 'prompt')"),
    "empty_dataset": (
        dict(train_dataset=datasets.Dataset.from_dict({"prompt": []})), DataError, "is empty"),
    "dataset_not_a_Dataset": (
        dict(train_dataset=[{"prompt": "1+1="}]), DataError, "must be a datasets.Dataset or IterableDataset (e.g. Dataset.from_list(rows)), got list"),
    "eval_dataset_without_prompt": (
        dict(eval_dataset=datasets.Dataset.from_list([{"text": "x"}])), DataError, "eval_dataset has no 'prompt' column"),
    "column_clashes_with_reward_argument": (
        dict(train_dataset=rows("1+1=", completions=["2"])), DataError,
        "clash with the arguments the trainer passes to reward functions"),
    "prompt_longer_than_max_prompt_length": (
        dict(train_dataset=rows("1+1=", "9" * 40), args=dict(max_prompt_length=32)), ConfigError,
        "Prompt at row 1 has 40 tokens, more than max_prompt_length=32; raise max_prompt_length or filter"),
    "eval_prompt_longer_than_max_prompt_length": (
        dict(eval_dataset=rows("1+1=", "9" * 40), args=dict(max_prompt_length=32)), ConfigError,
        "Prompt at row 1 of eval_dataset has 40 tokens, more than max_prompt_length=32"),
    "prompt_longer_than_context": (
        dict(train_dataset=rows(TOO_LONG), args=dict(max_prompt_length=None)), ModelError,
        "The longest prompt (600 tokens) plus max_completion_length=4 exceeds the model's context of 512 tokens"),
    "empty_prompt": (
        dict(train_dataset=rows("1+1=", "")), ConfigError, "Prompt at row 1 is empty after tokenisation"),
    "prompt_not_text": (
        dict(train_dataset=rows(12, 13)), DataError, "A prompt must be a string or a list of {'role', 'content'}"),
    "conversation_without_chat_template": (
        dict(train_dataset=rows([{"role": "user", "content": "hi"}]), processing_class=_no_chat_template_tokenizer),
        DataError, "the tokenizer has no chat_template; set tokenizer.chat_template or use plain-text prompts"),
    "reward_weights_length": (
        dict(args=dict(reward_weights=[1.0, 2.0])), ConfigError,
        "reward_weights has 2 entries but there are 1 reward functions; give one weight per function"),
    "unknown_reward_name": (
        dict(reward_funcs=["exact_matc"]), RewardError, "unknown reward 'exact_matc'. Did you mean 'exact_match'?"),
    "reward_module_missing": (
        dict(reward_funcs=["no_such_module:score"]), RewardError, "could not import module 'no_such_module'"),
    "unwritable_output_dir": (
        dict(args=dict(output_dir="/etc/passwd/run")), ConfigError, "output_dir '/etc/passwd/run' is not writable"),
    "missing_model_path": (
        dict(model="/nonexistent/model"), ModelError,
        "Model path '/nonexistent/model' does not exist; pass a folder written by save_pretrained or a hub name"),
    "model_of_wrong_type": (
        dict(model=42), ModelError, "model must be a path, a hub name, a PreTrainedModel or a PeftModel, got int"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_inputs_fail_before_the_model_loads(case, tmp_path, tiny_model_dir, prompt_dataset, no_model_load,
                                               monkeypatch):
    kwargs, error, message = CASES[case]
    kwargs = dict(kwargs)
    arguments = dict(
        model=kwargs.pop("model", tiny_model_dir), reward_funcs=kwargs.pop("reward_funcs", [frac_a]),
        args=config(tmp_path, **kwargs.pop("args", {})), train_dataset=kwargs.pop("train_dataset", prompt_dataset),
    )
    if callable(kwargs.get("processing_class")):
        kwargs["processing_class"] = kwargs["processing_class"](tiny_model_dir)
    with pytest.raises(error) as err:
        GRPOTrainer(**arguments, **kwargs)
    assert message in str(err.value)


def test_tokenizer_without_pad_token_warns_and_pads_with_eos(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.pad_token = None
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path), prompt_dataset, processing_class=tokenizer)
    assert "The tokenizer has no pad token; using its EOS token '<eos>' for padding." in caplog.text
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    trainer.train()  # and training works
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 1


# ---------------------------------------------------------------- train(), before generation


def _fake_checkpoint(out, step=2):
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    state = {"trainer": {"global_step": step}, "sampler": {}, "last_generation_metrics": {},
             "num_processes": 1}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


@pytest.mark.parametrize(
    "setup, resume, message",
    [
        ("checkpoint", None, "already holds checkpoints; resume with train(resume_from_checkpoint=True) / --resume, "
                             "set overwrite_output_dir=True, or choose another output_dir"),
        ("nothing", True, "resume_from_checkpoint=True but"),
        ("nothing", "missing", "is not a complete checkpoint (no trainer_state.json)"),
    ],
    ids=["output_dir_holds_checkpoints", "resume_without_checkpoint", "resume_incomplete_path"],
)
def test_bad_resume_fails_before_generation(setup, resume, message, tmp_path, tiny_model_dir, prompt_dataset,
                                            no_generation):
    out = tmp_path / "out"
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path), prompt_dataset)
    if setup == "checkpoint":
        _fake_checkpoint(out)
    if resume == "missing":
        resume = str(out / "checkpoint-7")
    with pytest.raises(ConfigError) as err:
        trainer.train(resume_from_checkpoint=resume)
    assert message in str(err.value)


# ---------------------------------------------------------------- reward functions, at step 1 (after generation)


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def raises(prompts, completions, **kwargs):
    return 1 / 0


def strings(prompts, completions, **kwargs):
    return ["good"] * len(completions)


@pytest.mark.parametrize(
    "reward, message",
    [
        (wrong_length, "reward function 'wrong_length' returned 1 values for a batch of 8 completions"),
        (raises, "reward function 'raises' raised ZeroDivisionError: division by zero"),
        (strings, "reward function 'strings' returned an invalid value for sample 0 (dataset row 1): \"'good'\" of type str is not a real number"),
    ],
    ids=["wrong_length", "raises", "returns_strings"],
)
def test_bad_reward_stops_at_step_1_with_its_name(reward, message, tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, [reward], config(tmp_path), prompt_dataset)
    with pytest.raises(RewardError) as err:
        trainer.train()
    assert message in str(err.value) and "Fix:" in str(err.value)
    assert trainer.state.global_step == 0


def test_all_none_rewards_warn_and_train_safely(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    def never_applies(prompts, completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer(tiny_model_dir, [never_applies], config(tmp_path, max_steps=2), prompt_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs: {" in caplog.text
    assert "generation batch for step 1" in caplog.text
    rows_ = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows_] == [1, 2] and all(r["loss"] == 0.0 for r in rows_)  # every advantage is 0
    assert all(r["nonfinite_skips"] == 0 for r in rows_)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # nothing to learn from


def test_reward_error_policy_none_counts_failures_and_continues(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    args = config(tmp_path, max_steps=2, reward_error_policy="none")
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(tiny_model_dir, [frac_a, raises], args, prompt_dataset).train()
    assert "reward function 'raises' raised ZeroDivisionError" in caplog.text
    assert [r["rewards/raises/failures"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [8, 8]


# ---------------------------------------------------------------- `grpo train CONFIG` (exit code 2, one line)


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: m\ndataset: d.jsonl\nreward_funcs: [exact_match]\nlearning_rat: 0.1\n",
         "Unknown option 'learning_rat'. Did you mean 'learning_rate'?"),
        ("dataset: d.jsonl\nreward_funcs: [exact_match]\n", "The config needs 'model'"),
        ("model: m\ndataset: /nonexistent/prompts.jsonl\nreward_funcs: [exact_match]\n",
         "Dataset file '/nonexistent/prompts.jsonl' does not exist"),
        ("model: m\ndataset: d.jsonl\nreward_funcs: [exact_match]\nbeta: lots\n", "beta='lots' should be float"),
    ],
    ids=["unknown_key_nearest_name", "missing_model_key", "missing_dataset_file", "wrong_type"],
)
def test_grpo_train_reports_config_errors_in_one_line(text, message, tmp_path, capsys, no_model_load):
    assert grpo_main(["train", _yaml(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo train: error: ") and message in err


def test_grpo_train_missing_config_file_and_resume_without_checkpoint(tmp_path, tiny_model_dir, capsys):
    assert grpo_main(["train", str(tmp_path / "none.yaml")]) == 2
    assert "Config file" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    path = _yaml(tmp_path, f"model: {tiny_model_dir}\ndataset: {data}\nreward_funcs: [exact_match]\n"
                           f"output_dir: {tmp_path / 'out'}\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    assert grpo_main(["train", path, "--resume"]) == 2
    assert "resume_from_checkpoint=True but" in capsys.readouterr().err


# ---------------------------------------------------------------- images


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from grpokit.tiny_vision import save, tiny_qwen2_vl

    model, processor = tiny_qwen2_vl()
    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    save(model, processor, folder)
    return str(folder), processor


def image_rows(n=8, **at):
    """n rows of an image question; at={row: image value} replaces a row's image."""
    from PIL import Image

    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    return datasets.Dataset.from_list([{"prompt": message, "image": at.get(f"row{i}", _png(Image.new(
        "RGB", (56, 56), (255, 0, 0))))} for i in range(n)])


def _png(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def broken_image_rows(tmp_path, case: str):
    """Four rows whose row 3 has a broken image of kind `case`, the others good ones."""
    from PIL import Image

    good = tmp_path / "good.png"
    Image.new("RGB", (56, 56), (255, 0, 0)).save(good)
    if case == "bytes":
        return image_rows(4, row3=b"not an image at all")
    if case == "path":
        return datasets.Dataset.from_list([{"prompt": "Which colour?", "image": str(good) if i < 3 else
                                            "/nonexistent/cat.png"} for i in range(4)])
    return datasets.Dataset.from_list([{"prompt": "Which colour?", "images": [3.5] if i == 3 else []}
                                       for i in range(4)])


@pytest.mark.parametrize("case, message", [
    ("bytes", r"train_dataset row 3, column 'image': the image \(19 bytes\) cannot be decoded"),
    ("path", r"train_dataset row 3, column 'image': the image file '/nonexistent/cat.png' does not exist"),
    ("number", r"train_dataset row 3, column 'images' item 0: an image must be a PIL image, a file path, bytes"),
])
def test_a_broken_image_is_named_by_its_row_before_the_model_loads(tmp_path, tiny_vlm, no_model_load, case,
                                                                      message):
    folder, _ = tiny_vlm
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(folder, frac_a, config(tmp_path), broken_image_rows(tmp_path, case))


def test_more_image_parts_than_images_is_named_by_its_row(tmp_path, tiny_vlm, no_model_load):
    folder, _ = tiny_vlm
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}]
    dataset = image_rows(4).map(lambda r, i: {"prompt": two if i == 2 else r["prompt"]}, with_indices=True)
    with pytest.raises(ConfigError, match=r"train_dataset row 2: the prompt has 2 image part\(s\) without an image "
                                          r"but the row has 1 image"):
        GRPOTrainer(folder, frac_a, config(tmp_path), dataset)


def test_a_text_processor_for_an_image_run_is_refused(tmp_path, tiny_vlm, no_model_load):
    folder, processor = tiny_vlm
    with pytest.raises(ConfigError, match=r"processing_class is a .*without an image processor; pass the model's "
                                          r"processor"):
        GRPOTrainer(folder, frac_a, config(tmp_path), image_rows(), processing_class=processor.tokenizer)


@pytest.mark.parametrize("overrides, message", [
    (dict(rollout_engine="vllm"), "rollout_engine='vllm' .* with image prompts is not supported yet"),
    (dict(use_vllm=True), r"rollout_engine='vllm' \(use_vllm=True\) with image prompts is not supported yet"),
])
def test_what_image_runs_cannot_do_yet_is_refused_up_front(tmp_path, tiny_vlm, no_model_load, overrides, message):
    folder, _ = tiny_vlm
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(folder, frac_a, config(tmp_path, **overrides), image_rows())


@pytest.mark.parametrize("column", ["image", "images"])
def test_an_image_column_beside_a_text_model_is_refused_not_dropped(tmp_path, tiny_model_dir, no_model_load, column):
    dataset = rows(*[f"{i}+{i}=" for i in range(8)], **{column: [f"img{i}.png" for i in range(8)]})
    with pytest.raises(ConfigError, match=f"the dataset column '{column}'"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), dataset)


def test_a_vision_language_run_on_transformers_4_is_refused_up_front(tmp_path, tiny_vlm, no_model_load, monkeypatch):
    import transformers

    folder, _ = tiny_vlm
    monkeypatch.setattr(transformers, "__version__", "4.56.0")
    with pytest.raises(ConfigError, match=r"Vision-language training needs transformers>=5.0 .* transformers 4.56.0 "
                                          r"is installed"):
        GRPOTrainer(folder, frac_a, config(tmp_path), image_rows())


@pytest.mark.parametrize("column, value", [("image", None), ("images", [])])
def test_an_image_column_without_any_image_is_no_image_run(tmp_path, tiny_model_dir, no_generation, column, value):
    """TRL's rule: None (or an empty list) in every row means no images; a text model trains on such a dataset."""
    dataset = rows(*[f"{i}+{i}=" for i in range(8)], **{column: [value] * 8})
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), dataset)
    assert trainer.setup.images is None


def test_fsdp_with_rows_without_images_is_refused(tmp_path, tiny_vlm, no_model_load):
    """A process whose batch had no image would skip the tower's FSDP gathers the others make: refused."""
    folder, _ = tiny_vlm
    dataset = image_rows(8).map(lambda r, i: {"image": None if i == 5 else r["image"]}, with_indices=True)
    with pytest.raises(ConfigError, match="FSDP with image prompts needs an image in every row"):
        GRPOTrainer(folder, frac_a, config(tmp_path, fsdp="full_shard"), dataset)


def test_an_image_column_filtered_to_no_image_is_no_image_run(tmp_path, tiny_model_dir, no_generation):
    """After select/filter, only the rows kept decide (read through the dataset's indices)."""
    dataset = rows(*[f"{i}+{i}=" for i in range(8)], image=[None] * 7 + ["img.png"]).select(range(7))
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), dataset)
    assert trainer.setup.images is None


def _system_image_rows():
    message = [{"role": "system", "content": [{"type": "image"}, {"type": "text", "text": "Look."}]},
               {"role": "user", "content": [{"type": "text", "text": "Which colour?"}]}]
    from PIL import Image

    return datasets.Dataset.from_list([{"prompt": message, "image": Image.new("RGB", (56, 56), (255, 0, 0))}] * 8)


@pytest.mark.parametrize("family, message", [
    ("qwen3_vl", r"train_dataset row 0: the prompt has 1 image\(s\) but its encoded ids hold no image token"),
    ("gemma3", r"train_dataset row 0: the processor could not encode the prompt \(\w+Error"),
])
def test_an_image_part_the_template_cannot_place_is_named_before_the_model_loads(tmp_path, no_model_load, family,
                                                                                  message):
    """Qwen3-VL's template drops an image in a system message (the first forward would find features for no
    token); Gemma 3's raises inside Jinja: both named by row, up front."""
    from grpokit.tiny_vision import FAMILIES, save

    folder = str(save(*FAMILIES[family](), tmp_path / family))
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(folder, frac_a, config(tmp_path), _system_image_rows())


def test_a_processor_of_another_family_is_refused(tmp_path, tiny_vlm, no_model_load):
    from grpokit.tiny_vision import FAMILIES

    folder, _ = tiny_vlm
    _, other = FAMILIES["llava_next"]()
    with pytest.raises(ConfigError, match=r"processing_class is a LlavaNextProcessor whose image token \(id 100\) is "
                                          r"not the model's \(a qwen2_vl model"):
        GRPOTrainer(folder, frac_a, config(tmp_path), image_rows(), processing_class=other)


@pytest.mark.parametrize("value, message", [
    (b"", "the image bytes are empty"),
    ({"bytes": b"", "path": None}, "the image bytes are empty"),
    ([[1, 2], [3, 4]], r"convert it with PIL.Image.fromarray"),
])
def test_empty_bytes_and_arrays_get_their_own_message(value, message):
    from grpokit.vision import ImageError, load_image

    with pytest.raises(ImageError, match=message):
        load_image(value, "train_dataset row 0, column 'image'")


def test_sixteen_bit_images_are_scaled_not_clipped_white():
    import numpy as np
    from PIL import Image

    from grpokit.vision import load_image

    source = Image.fromarray(np.full((8, 8), 30000, np.uint16))
    assert source.mode.startswith("I;16")
    image = load_image(source, "row 0")
    assert image.mode == "L" and image.getpixel((0, 0)) == round(30000 / 65535 * 255 - 0.5)
