"""grpokit/train/weights.py: the policy's weights as a stream, one rule for every consumer (engines, exports).
The sharded (FSDP2) stream is checked at two processes by tests/scripts/fsdp_engine_checks.py."""

import pytest
import torch
from safetensors.torch import load_file

from grpokit.tiny import tiny_qwen2
from grpokit.rollout.weights_file import write_model_folder
from grpokit.train.weights import named_weights


def model(tied=True, seed=0):
    m = tiny_qwen2(vocab_size=64, hidden_size=16, num_layers=2, seed=seed)
    if not tied:
        m.config.tie_word_embeddings = False
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone() + 1.0)
    return m


def test_every_key_whole_and_a_tied_weight_one_tensor_under_each_name():
    m = model(tied=True)
    streamed = dict(named_weights(m))
    assert list(streamed) == list(m.state_dict())
    for name, tensor in m.state_dict().items():
        assert torch.equal(streamed[name], tensor) and not streamed[name].requires_grad
    assert streamed["lm_head.weight"] is streamed["model.embed_tokens.weight"]  # one tensor, two names
    assert streamed["lm_head.weight"].data_ptr() == m.lm_head.weight.data_ptr()  # not a copy


def test_specs_name_the_stream_in_order_without_reading_it():
    m = model(tied=False)
    stream = named_weights(m)
    assert [(n, tuple(s), d) for n, s, d in stream.specs()] == [(n, tuple(t.shape), t.dtype) for n, t in stream]
    assert not stream.collective


def test_a_peft_model_streams_its_merged_base_weights_and_stays_unmerged():
    peft = pytest.importorskip("peft")
    m = model(tied=False, seed=1)
    lora = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    streamed = dict(named_weights(lora))
    lora.merge_adapter()
    expected = {k.replace(".base_layer.", "."): v.clone() for k, v in lora.get_base_model().state_dict().items()
                if "lora_" not in k}
    lora.unmerge_adapter()
    assert list(streamed) == list(expected) and "model.layers.0.self_attn.q_proj.weight" in streamed
    for name, tensor in expected.items():
        assert torch.equal(streamed[name], tensor), name
    assert not torch.equal(streamed["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    for name, tensor in lora.state_dict().items():  # unmerged again: the adapter trains on the base weights
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=1e-6)


def test_pushes_leave_the_base_weights_bit_identical():
    """Plain LoRA: the merged weights are computed beside the base (PEFT's merge and unmerge round trip drifts the
    frozen base by rounding at every push; the reference, the base with the adapter off, would drift with it)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model(tied=False, seed=4), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                          init_lora_weights=False))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    for _ in range(5):
        dict(named_weights(lora))
    for name, tensor in lora.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not any(getattr(m, "merged", False) for m in lora.modules())


def test_other_adapter_kinds_are_merged_by_peft_and_unmerged_when_a_consumer_stops_early():
    peft = pytest.importorskip("peft")
    dora = peft.get_peft_model(model(tied=False, seed=2), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          use_dora=True, init_lora_weights=False))
    base = dora.get_base_model().model.layers[0].self_attn.q_proj
    expected = dict(named_weights(dora))  # PEFT's own merge (DoRA rescales: not a plain sum)
    dora.merge_adapter()
    merged = base.base_layer.weight.detach().clone()
    dora.unmerge_adapter()
    torch.testing.assert_close(expected["model.layers.0.self_attn.q_proj.weight"], merged, rtol=0, atol=0)
    stream = iter(named_weights(dora))
    next(stream)
    assert base.merged
    stream.close()  # what garbage collection does to an abandoned generator
    assert not base.merged


def test_export_writes_a_folder_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    m = model(tied=True, seed=3)
    write_model_folder(named_weights(m), m.config, m.generation_config, tmp_path / "out")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(m.state_dict())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_engine_given_the_model_instead_of_a_stream_says_what_to_pass():
    from grpokit.rollout.vllm_engine import _check_stream

    with pytest.raises(TypeError, match="named_weights"):
        _check_stream(model())


def test_the_learner_exports_the_policy_it_trains(tiny_model_dir, prompt_dataset, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpokit import GRPOConfig, GRPOTrainer
    from tests.helpers import frac_a

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, report_to=[], save_strategy="no")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=frac_a, args=args, train_dataset=prompt_dataset)
    trainer.train()
    trainer.learner.export(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    for name, tensor in trainer.learner.unwrapped.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_a_peft_model_can_stream_its_adapter_alone():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model(tied=False, seed=5), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          init_lora_weights=False))
    expected = peft.get_peft_model_state_dict(lora)
    stream = named_weights(lora, merge=False)
    streamed = dict(stream)
    assert list(streamed) == list(expected) and all("lora_" in name for name in streamed)
    assert all(torch.equal(streamed[name], tensor) for name, tensor in expected.items())
    assert [name for name, _, _ in stream.specs()] == list(expected)


def test_an_export_that_cannot_be_written_is_a_save_error_naming_the_folder(tiny_model_dir, prompt_dataset,
                                                                              tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.errors import SaveError
    from tests.helpers import frac_a

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, report_to=[], save_strategy="no")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=frac_a, args=args, train_dataset=prompt_dataset)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SaveError, match="a-file"):
        trainer.learner.export(blocker / "export")


def test_another_tuner_kind_is_merged_by_peft_not_skipped():
    """IA3 is not LoRA: its layers are merged by PEFT's own merge (the stream must not leave them out)."""
    peft = pytest.importorskip("peft")
    ia3 = peft.get_peft_model(model(tied=False, seed=6), peft.IA3Config(target_modules=["q_proj", "down_proj"],
                                                                        feedforward_modules=["down_proj"],
                                                                        init_ia3_weights=False))
    base = ia3.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    streamed = dict(named_weights(ia3))["model.layers.0.self_attn.q_proj.weight"]
    ia3.merge_adapter()
    expected = ia3.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    ia3.unmerge_adapter()
    # IA3's merge scales and its unmerge divides: the round trip moves the base by rounding, hence the tolerance
    torch.testing.assert_close(streamed, expected, rtol=1e-6, atol=0)
    assert (streamed - base).abs().max() > 1e-3  # merged, not left out


def test_peft_names_map_to_the_plain_models_for_every_tuner_and_adapter_name():
    """The stream's names and values are those of merge_and_unload() on a copy: IA3's vectors, a module saved
    under an adapter not named "default", and only the active adapter's copy of it."""
    import copy

    peft = pytest.importorskip("peft")
    runs = [
        peft.get_peft_model(model(tied=False, seed=7), peft.IA3Config(target_modules=["q_proj", "down_proj"],
                                                                      feedforward_modules=["down_proj"],
                                                                      init_ia3_weights=False)),
        peft.get_peft_model(model(tied=False, seed=8), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                       modules_to_save=["lm_head"],
                                                                       init_lora_weights=False), adapter_name="pol"),
    ]
    for peft_model in runs:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "modules_to_save" in name:
                    p.add_(0.5)  # the saved copy trains: it must be the one streamed
        streamed = dict(named_weights(peft_model))
        expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
        assert list(streamed) == list(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(streamed[name], tensor, rtol=1e-6, atol=1e-7)


def test_an_unknown_peft_feature_is_refused_not_pushed_under_a_wrong_name():
    peft = pytest.importorskip("peft")
    tokens = peft.get_peft_model(model(tied=False, seed=9), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                            trainable_token_indices=[3, 5]))
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match="token_adapter.*merge the adapter yourself"):
        dict(named_weights(tokens))


def test_the_weights_file_refuses_a_stream_that_breaks_its_specs_and_leaves_no_partial_file(tmp_path):
    from grpokit.rollout.weights_file import WeightsFileError, write_safetensors
    from grpokit.train.weights import TensorStream

    class Short(TensorStream):
        def __iter__(self):
            return iter(list(self.tensors.items())[:1])

    class Failing(TensorStream):
        def __iter__(self):
            yield "a", self.tensors["a"]
            raise ValueError("a gather failed")

    tensors = {"a": torch.zeros(2), "b": torch.ones(3)}
    with pytest.raises(WeightsFileError, match="gave 1 tensors where its specs announced 2"):
        write_safetensors(Short(tensors), tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match="a gather failed"):
        write_safetensors(Failing(tensors), tmp_path / "failing.safetensors")
    with pytest.raises(WeightsFileError, match="complex64, which safetensors does not store"):
        write_safetensors(TensorStream({"c": torch.zeros(2, dtype=torch.complex64)}), tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    write_safetensors(TensorStream(tensors), tmp_path / "whole.safetensors")
    assert torch.equal(load_file(tmp_path / "whole.safetensors")["b"], tensors["b"])
