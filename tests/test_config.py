"""GRPOConfig: every validation path says what is wrong and how to fix it; YAML and CLI coercion."""

import dataclasses

import pytest

from grpokit.config import ConfigError, GRPOConfig, coerce_option, field_docs, load_yaml


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "ppo"}, "choose an aggregation (bnpo, dapo, dr_grpo, grpo, sequence_sum) or a policy objective (cispo, clip, gmpo, luspo, sapo, vespo)"),
        ({"policy_objective": "ppo"}, "choose one of: cispo, clip, gmpo, luspo, sapo, vespo"),
        ({"loss_type": "cispo", "policy_objective": "sapo"}, "set loss_type to an aggregation"),
        ({"loss_type": "gmpo", "importance_sampling_level": "sequence"}, "leave it at 'token'"),
        ({"kl_estimator": "k4"}, "choose one of: k1, k2, k3, k3+"),
        ({"advantage_estimator": "gae"}, "choose one of: grpo, reinforce_plus_plus_baseline, rloo"),
        ({"advantage_estimator": "reinforce_plus_plus_baseline", "scale_rewards": "batch"}, "leave scale_rewards"),
        ({"kl_in_reward": True}, "kl_in_reward=True needs beta > 0"),
        ({"sync_ref_model": True}, "sync_ref_model=True needs beta > 0"),
        ({"ref_model_mixup_alpha": 0.0, "beta": 0.1}, "ref_model_mixup_alpha=0.0 must be a finite number in (0, 1]"),
        ({"ref_model_sync_steps": 0}, "ref_model_sync_steps=0 must be an integer in [1, 1000000000]"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5 must be a finite number in [0, 1]"),
        ({"entropy_coef": float("nan")}, "entropy_coef=nan must be a finite number"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_max=0.1 must be at least entropy_coef_min=0.5"),
        ({"entropy_coef_delta": 0.0}, "entropy_coef_delta=0.0 must be a finite number in (0, 10]"),
        ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold=0.0 must be a finite number in (0, 100] (or null)"),
        ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg=-1.0 must be a finite number in (0, 100]"),
        ({"vespo_k_pos": float("inf")}, "vespo_k_pos=inf must be a finite number"),
        ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds=0 must be an integer in [1, 10000]"),
        ({"scale_rewards": "std"}, "choose one of: batch, group, none"),
        ({"multi_objective_aggregation": "mean"}, "normalize_then_sum, sum_then_normalize"),
        ({"importance_sampling_level": "seq"}, "sequence, sequence_token, token"),
        ({"lr_scheduler_type": "step"}, "constant, constant_with_warmup, cosine"),
        ({"save_strategy": "best"}, "epoch, no, steps"),
        ({"reward_error_policy": "skip"}, "none, raise"),
        ({"report_to": ["mlflow"]}, "tensorboard, trackio, wandb"),
        ({"num_generations": 1}, "at least 2 per prompt"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0 must be an integer in [1, 65536]"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be an integer in [1, 65536]"),
        ({"num_iterations": 0}, "num_iterations=0 must be an integer in [1, 1024]"),
        ({"max_completion_length": 0}, "max_completion_length=0 must be an integer in [1, 16777216]"),
        ({"max_prompt_length": 0}, "max_prompt_length=0 must be an integer in [1, 16777216] (or null)"),
        ({"max_consecutive_nonfinite_steps": 0}, "max_consecutive_nonfinite_steps=0 must be an integer in [1, 1000000000]"),
        ({"steps_per_generation": 0}, "steps_per_generation=0 must be an integer in [1, 65536] (or null)"),
        ({"save_total_limit": 0}, "save_total_limit=0 must be an integer in [1, 1000000000] (or null)"),
        ({"steps_per_generation": 2, "generation_batch_size": 16}, "not both"),
        ({"per_device_train_batch_size": 6}, "not divisible by num_generations=8"),
        ({"generation_batch_size": 12}, "must be a multiple of per_device_train_batch_size"),
        ({"max_steps": 0}, "max_steps=0 must be -1 or an integer in [1, 1000000000]. -1 uses num_train_epochs."),
        ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs=0.0 must be a finite number in (0, 1000000]"),
        ({"learning_rate": -1e-5}, "learning_rate=-1e-05 must be a finite number in [0, 1]"),
        ({"warmup_ratio": 1.0}, "warmup_ratio=1.0 must be a finite number in [0, 1)"),
        ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0 must be a finite number in [0, inf]. 0 turns clipping off"),
        ({"epsilon": 1.0}, "epsilon=1.0 must be below 1"),
        ({"epsilon_high": -0.1}, "DAPO uses 0.28"),
        ({"delta": 1.1}, "must exceed 1 + epsilon_high"),
        ({"beta": -0.01}, "beta=-0.01 must be a finite number in [0, 100]"),
        ({"beta": float("nan")}, "beta=nan must be a finite number in [0, 100]"),
        ({"temperature": 0.0}, "temperature=0.0 must be a finite number in [0.01, 100]"),
        ({"top_p": 0.0}, "top_p=0.0 must be a finite number in (0, 1]"),
        ({"top_k": -1}, "top_k=-1 must be an integer in [0, 16777216]. 0 disables."),
        ({"min_p": 1.0}, "min_p=1.0 must be a finite number in [0, 1) (or null)"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be a finite number in (0, 100]. 1.0 disables it"),
        ({"reward_weights": [1.0, "a"]}, "must be a list of finite numbers"),
    ],
)
def test_every_validation_path(kwargs, message):
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**kwargs)
    assert message in str(err.value)


def test_defaults_are_valid_and_geometry_resolves():
    c = GRPOConfig()
    assert c.resolved_steps_per_generation() == 1
    assert c.global_generation_batch_size() == 8
    c = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert c.global_generation_batch_size() == 8
    c = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=16)
    assert c.resolved_steps_per_generation() == 4
    assert c.resolved_epsilon_high == 0.2
    assert GRPOConfig(epsilon_high=0.28).resolved_epsilon_high == 0.28


def test_steps_per_generation_need_not_be_a_multiple_of_gradient_accumulation_steps():
    # TRL accepts it: optimizer steps take micro-batches in turn across generation batches (pipeline.py)
    assert GRPOConfig(gradient_accumulation_steps=2, steps_per_generation=3).resolved_steps_per_generation() == 3
    assert GRPOConfig(gradient_accumulation_steps=4, steps_per_generation=1).global_generation_batch_size() == 8


def test_geometry_is_rechecked_for_the_number_of_processes():
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4)
    c.check_geometry(2)
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, generation_batch_size=4)
    with pytest.raises(ConfigError, match="multiple of per_device_train_batch_size x processes = 8"):
        c.check_geometry(2)


def test_unknown_key_names_the_nearest_valid_key():
    with pytest.raises(ConfigError, match="Did you mean 'num_generations'"):
        GRPOConfig.from_dict({"num_generation": 4})
    with pytest.raises(ConfigError, match="grpo train --help"):
        GRPOConfig.from_dict({"zzzz": 1})


def test_yaml_loading_and_type_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1\nbeta: 0.04\nepsilon_high: 0.28\nreport_to: []\ngeneration_kwargs: {min_new_tokens: 4}\n")
    c = GRPOConfig.from_dict(load_yaml(path))
    assert c.learning_rate == 1.0 and isinstance(c.learning_rate, float)
    assert c.generation_kwargs == {"min_new_tokens": 4}
    path.write_text("beta: lots\n")
    with pytest.raises(ConfigError, match="beta='lots' should be float"):
        GRPOConfig.from_dict(load_yaml(path))
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")


def test_command_line_strings_are_coerced():
    assert coerce_option("beta", "0.04") == 0.04
    assert coerce_option("num_generations", "4") == 4
    assert coerce_option("epsilon_high", "null") is None
    assert coerce_option("gradient_checkpointing", "true") is True
    assert coerce_option("output_dir", "123") == "123"
    assert coerce_option("save_strategy", "no") == "no"  # YAML 1.1 would read a bare no as False
    assert GRPOConfig.from_dict({"save_strategy": "no"}).save_strategy == "no"
    assert coerce_option("reward_weights", "[1, 0.5]") == [1.0, 0.5]
    with pytest.raises(ConfigError, match="num_generations=4.5 should be int"):
        coerce_option("num_generations", "4.5")
    assert coerce_option("loss_type", "cispo") == "cispo"  # the registry, not the annotation, decides
    with pytest.raises(ConfigError, match="loss_type='ppo' is not valid"):
        GRPOConfig.from_dict({"loss_type": "ppo"})


def test_every_field_has_a_docstring():
    docs = field_docs()
    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert [n for n in names if not docs.get(n)] == []
    assert docs["beta"].startswith("KL coefficient")


SCHEDULES = [  # (lr_scheduler_type, lr_scheduler_kwargs, learning_rate, the problem or None)
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 1e-6, None),
    ("cosine", {"num_cycles": 2}, 1e-6, None),
    ("inverse_sqrt", {"timescale": 4}, 1e-6, None),
    ("warmup_stable_decay", {"num_decay_steps": 2}, 1e-6, None),
    ("constant", {"anything": 1}, 1e-6, None),  # get_scheduler passes a constant schedule no kwargs
    ("cosine", {"num_cycle": 2}, 1e-6, "get_cosine_schedule_with_warmup() got an unexpected keyword argument 'num_cycle'"),
    ("linear", {"num_warmup_steps": 3}, 1e-6, "got multiple values for keyword argument 'num_warmup_steps'"),
    ("warmup_stable_decay", {}, 1e-6, "get_wsd_schedule() missing a required argument: 'num_decay_steps'"),
    ("cosine_with_min_lr", {}, 1e-6, "One of min_lr or min_lr_rate should be set"),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-7, "min_lr_rate": 0.1}, 1e-6, "Only one of min_lr or min_lr_rate"),
    ("polynomial", {"lr_end": 1e-5}, 1e-6, "lr_end (1e-05) must be smaller than initial lr (1e-06)"),
    ("warmup_stable_decay", {"num_decay_steps": 2, "decay_type": "step"}, 1e-6,
     "Unknown decay type: step, expected 'linear', 'cosine' or '1-sqrt'"),
]


@pytest.mark.parametrize("name, kwargs, lr, problem", SCHEDULES)
def test_the_schedule_is_checked_without_building_an_optimizer(name, kwargs, lr, problem, monkeypatch):
    import torch

    def built(*args, **kw):
        raise AssertionError("validation built an optimizer or a learning-rate schedule")

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", built)
    monkeypatch.setattr(torch.optim.lr_scheduler.LRScheduler, "__init__", built)
    options = dict(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, learning_rate=lr)
    if problem is None:
        GRPOConfig(**options)
        return
    with pytest.raises(ConfigError) as info:
        GRPOConfig(**options)
    assert str(info.value).startswith(f"lr_scheduler_type={name!r} with lr_scheduler_kwargs={kwargs}: ")
    assert problem in str(info.value)


@pytest.mark.parametrize("name, kwargs, lr, problem", SCHEDULES)
def test_the_schedule_check_refuses_what_get_scheduler_refuses(name, kwargs, lr, problem):
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    if problem is None:
        get_scheduler(name, optimizer, 1, 10, scheduler_specific_kwargs=dict(kwargs))
        return
    with pytest.raises((TypeError, ValueError)):
        get_scheduler(name, optimizer, 1, 10, scheduler_specific_kwargs=dict(kwargs))


def test_values_of_the_wrong_type_from_python_name_every_option():
    """From Python nothing parses the values first: a string where a number belongs must not surface as a bare
    TypeError from a comparison deep in the checks."""
    with pytest.raises(ConfigError) as info:
        GRPOConfig(num_generations="8", tool_timeout="x", max_tool_calling_iterations=3)
    assert str(info.value) == (
        "2 problems in the options:\n  - num_generations='8' must be an integer in [2, 65536]. GRPO compares "
        "completions within a group, so it needs at least 2 per prompt (8 or 16 is typical).\n"
        "  - tool_timeout='x' must be a finite number in (0, 86400]. Seconds one tool call may take, e.g. 10.")
    with pytest.raises(ConfigError, match=r"^environment_factory=5 should be str or null\.$"):
        GRPOConfig(environment_factory=5)
