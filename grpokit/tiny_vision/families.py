"""One builder per vision-language family: (model, processor), random init, tiny, offline.

Each model is the family's own ForConditionalGeneration class on the family's own config classes, shrunk (hidden
64, 2 text layers, a 1-2 layer vision tower of width 32, images of 28-64 pixels a side so that one image is 4 to
about 20 image tokens); each processor is the family's own processor class with its own image processor class and
a character-level tokenizer carrying the family's special tokens, BOS/EOS/pad choices and verbatim chat template
(templates.py). The vocabulary is the tokenizer's, exactly. Shapes and token choices follow the checkpoint named
in each docstring; what cannot be the same at this size (vocabulary, ids, widths) is said there.
"""

from __future__ import annotations

from grpokit.tiny_vision import templates
from grpokit.tiny_vision.build import (
    char_tokenizer,
    image_processor,
    seeded,
    set_generation_ids,
    token_ids,
    video_processor_optional,
)

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_5_ADDED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>")
QWEN3_ADDED = QWEN2_5_ADDED + ("<tool_response>", "</tool_response>", "<think>", "</think>")
GEMMA3_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>")
LLAVA_SPECIAL = ("<unk>", "<s>", "</s>", "<image>", "<pad>")
ROW_COL = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
SMOLVLM_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                   "<end_of_utterance>", "<global-img>") + ROW_COL


def _qwen_tokenizer(added: tuple[str, ...], template: str):
    """Qwen2 tokenizer conventions: no BOS, EOS <|im_end|> (the chat checkpoints'), pad <|endoftext|>."""
    return char_tokenizer(QWEN_SPECIAL, added=added, template=template, eos="<|im_end|>", pad="<|endoftext|>")


def _qwen_text(tok, hidden_size: int, num_layers: int, mrope: dict, **extra) -> dict:
    """A Qwen text config: 4 heads of 16, 2 KV heads, multimodal RoPE split as `mrope` says."""
    ids = token_ids(tok, bos_token_id="<|endoftext|>", eos_token_id="<|im_end|>", pad_token_id="<|endoftext|>")
    return dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, rope_parameters={"rope_type": "default", **mrope}, **ids, **extra)


def _split(hidden_size: int, *parts: int) -> list[int]:
    """mRoPE sections in these proportions over the rotary half of a head (4 heads: hidden_size / 8 frequencies)."""
    unit = hidden_size // (8 * sum(parts))
    return [p * unit for p in parts]


def _qwen_finish(model, tok):
    """Qwen chat checkpoints' generation_config.json: stop at <|im_end|> or <|endoftext|>, pad <|endoftext|>."""
    set_generation_ids(model, tok, ("<|im_end|>", "<|endoftext|>"), bos="<|endoftext|>")
    return model


def _qwen_vision_ids(tok) -> dict:
    return token_ids(tok, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                     vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")


def tiny_qwen2_vl(hidden_size: int = 64, num_layers: int = 2, image_size: int = 56, seed: int = 0):
    """Qwen2-VL (as Qwen/Qwen2-VL-2B-Instruct: tied embeddings, ViT patch 14, 2x2 merge, temporal patch 2, mRoPE
    split 2:3:3 over t/h/w as 16:24:24). Images resize to at most image_size**2 pixels in multiples of 28 (at
    least 56x56): a 56x56 image is a 4x4 patch grid, 4 <|image_pad|> tokens."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    video_processor_optional()
    tok = _qwen_tokenizer((), templates.QWEN2_VL)
    images = image_processor("Qwen2VLImageProcessor", min_pixels=56 * 56, max_pixels=image_size**2)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=templates.QWEN2_VL)
    config = Qwen2VLConfig(
        text_config=_qwen_text(tok, hidden_size, num_layers,
                               {"mrope_section": _split(hidden_size, 2, 3, 3), "rope_theta": 1e6}),
        vision_config={"depth": num_layers, "embed_dim": 32, "hidden_size": hidden_size, "num_heads": 2,
                       "mlp_ratio": 2},
        tie_word_embeddings=True, **_qwen_vision_ids(tok))
    return _qwen_finish(seeded(lambda: Qwen2VLForConditionalGeneration(config), seed), tok), processor


def tiny_qwen2_5_vl(hidden_size: int = 64, num_layers: int = 2, image_size: int = 56, seed: int = 0,
                    vision_size: int = 32):
    """Qwen2.5-VL (as Qwen/Qwen2.5-VL-3B-Instruct: tied embeddings, SwiGLU ViT with RMSNorm, window attention
    with full attention in the last block, patch 14, 2x2 merge; Qwen2-VL's image processor class and template;
    <tool_call> and FIM added tokens). A 56x56 image is 4 <|image_pad|> tokens; vision_size: the ViT's width
    (its heads 16 wide, its MLP twice as wide)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )

    video_processor_optional()
    tok = _qwen_tokenizer(QWEN2_5_ADDED, templates.QWEN2_VL)
    images = image_processor("Qwen2VLImageProcessor", min_pixels=56 * 56, max_pixels=image_size**2)
    processor = Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, chat_template=templates.QWEN2_VL)
    vision = {"depth": num_layers, "hidden_size": vision_size, "intermediate_size": 2 * vision_size,
              "num_heads": max(2, vision_size // 16),
              "out_hidden_size": hidden_size, "window_size": 112, "fullatt_block_indexes": [num_layers - 1],
              "tokens_per_second": 2}
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text(tok, hidden_size, num_layers,
                               {"mrope_section": _split(hidden_size, 2, 3, 3), "rope_theta": 1e6}),
        vision_config=vision, tie_word_embeddings=True, **_qwen_vision_ids(tok))
    return _qwen_finish(seeded(lambda: Qwen2_5_VLForConditionalGeneration(config), seed), tok), processor


def tiny_qwen3_vl(hidden_size: int = 64, num_layers: int = 2, image_size: int = 64, seed: int = 0):
    """Qwen3-VL (as Qwen/Qwen3-VL-2B-Instruct: tied embeddings, patch 16, 2x2 merge, learned position embeddings
    interpolated to the grid, DeepStack features from the first vision block into the first text layers,
    interleaved mRoPE split as 24:20:20 -> 4:2:2; image mean/std 0.5; Qwen3's added tokens). Images resize to at
    most image_size**2 pixels in multiples of 32: a 64x64 image is 4 <|image_pad|> tokens."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )

    video_processor_optional()
    tok = _qwen_tokenizer(QWEN3_ADDED, templates.QWEN3_VL)
    images = image_processor("Qwen2VLImageProcessor", patch_size=16, merge_size=2, temporal_patch_size=2,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3,
                             size={"shortest_edge": 32 * 32, "longest_edge": image_size**2})
    processor = Qwen3VLProcessor(image_processor=images, tokenizer=tok, chat_template=templates.QWEN3_VL)
    mrope = {"mrope_section": [4, 2, 2], "mrope_interleaved": True, "rope_theta": 5e6}
    vision = {"depth": num_layers, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": hidden_size, "patch_size": 16, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0]}
    config = Qwen3VLConfig(text_config=_qwen_text(tok, hidden_size, num_layers, mrope, head_dim=16),
                           vision_config=vision, tie_word_embeddings=True, **_qwen_vision_ids(tok))
    return _qwen_finish(seeded(lambda: Qwen3VLForConditionalGeneration(config), seed), tok), processor


def tiny_gemma3(hidden_size: int = 64, num_layers: int = 2, image_size: int = 56, seed: int = 0):
    """Gemma 3 (as google/gemma-3-4b-it: SigLIP tower without its pooling head, patch 14, pooled to
    mm_tokens_per_image soft tokens; one sliding-window and one global layer; BOS added by the tokenizer and by
    the template; EOS <eos>, turns end in <end_of_turn>, both stop generation; image mean/std 0.5). Every image
    resizes to image_size x image_size: 56x56 is 4x4 patches pooled 2x2, so <start_of_image> becomes 4
    <image_soft_token> between <start_of_image> and <end_of_image>; the processor also returns token_type_ids
    (1 on image tokens)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )

    tok = char_tokenizer(GEMMA3_SPECIAL, template=templates.GEMMA3, bos="<bos>", eos="<eos>", pad="<pad>",
                         unk="<unk>", add_bos=True, named={"boi_token": "<start_of_image>",
                                                          "eoi_token": "<end_of_image>",
                                                          "image_token": "<image_soft_token>"})
    per_side = image_size // 14 // 2
    images = image_processor("Gemma3ImageProcessor", size={"height": image_size, "width": image_size},
                             image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2)
    processor = Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=templates.GEMMA3,
                                image_seq_length=per_side**2)
    ids = token_ids(tok, pad_token_id="<pad>", eos_token_id="<eos>", bos_token_id="<bos>")
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=512, max_position_embeddings=2048,
                layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["full_attention"] * (
                    num_layers % 2), **ids)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 2,
              "image_size": image_size, "patch_size": 14, "vision_use_head": False}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=per_side**2,
                          **token_ids(tok, boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>",
                                      image_token_index="<image_soft_token>"))
    model = seeded(lambda: _gemma3_model(Gemma3ForConditionalGeneration, config), seed)
    set_generation_ids(model, tok, ("<eos>", "<end_of_turn>"), bos="<bos>")
    return model, processor


def _gemma3_model(cls, config):
    """Gemma 3's init sets the image projection to zeros (modeling_gemma3.py, _init_weights), so a random-init model
    would not see its images at all; here it is normal(0, initializer_range) like the other weights."""
    import torch

    model = cls(config)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=config.initializer_range)
    return model


def tiny_llava_next(hidden_size: int = 64, num_layers: int = 2, image_size: int = 28, seed: int = 0):
    """LLaVA-NeXT (as llava-hf/llava-v1.6-mistral-7b-hf: CLIP tower, patch 14, features of the second-last layer
    without CLS, a 2-layer GELU projector, Mistral text model; "anyres": the image at base resolution plus tiles of
    the best-fitting grid point, unpadded, with a learned newline after each row; BOS <s> added by the tokenizer).
    Grid points are the 336-pixel ones scaled to image_size: a 56x56 image is 4 base + 16 tile features + 4
    newlines = 24 <image> tokens."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )

    tok = char_tokenizer(LLAVA_SPECIAL, template=templates.LLAVA_NEXT, bos="<s>", eos="</s>", pad="<pad>",
                         unk="<unk>", add_bos=True)
    s = image_size
    pinpoints = [[s, 2 * s], [2 * s, s], [2 * s, 2 * s], [3 * s, s], [s, 3 * s]]
    images = image_processor("LlavaNextImageProcessor", size={"shortest_edge": s}, crop_size={"height": s, "width": s},
                             image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                                   vision_feature_select_strategy="default", chat_template=templates.LLAVA_NEXT,
                                   num_additional_image_tokens=1)
    text = dict(model_type="mistral", vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                max_position_embeddings=2048, rope_theta=1e6,
                **token_ids(tok, pad_token_id="<pad>", eos_token_id="</s>", bos_token_id="<s>"))
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": s, "patch_size": 14, "projection_dim": 32}
    config = LlavaNextConfig(text_config=text, vision_config=vision, image_grid_pinpoints=pinpoints,
                             image_seq_length=(s // 14) ** 2, **token_ids(tok, image_token_index="<image>"))
    model = seeded(lambda: LlavaNextForConditionalGeneration(config), seed)
    set_generation_ids(model, tok, ("</s>",), bos="<s>")
    return model, processor


def tiny_smolvlm(hidden_size: int = 64, num_layers: int = 2, image_size: int = 64, seed: int = 0):
    """SmolVLM (as HuggingFaceTB/SmolVLM-256M-Instruct, which ships Idefics3's model, config and processor
    classes with SmolVLM's template and SmolLM2 tokenizer: BOS <|im_start|> (not added), EOS <end_of_utterance>,
    pad <|im_end|>; SigLIP tower, patch 16, pixel shuffle, image mean/std 0.5). Images resize to a longest edge of
    2*image_size and split into image_size tiles plus a global image, each tile image_seq_len = 4 <image> tokens
    between <fake_token_around_image> and a <row_i_col_j> or <global-img> tag: a 64x64 image is 5 x 4 = 20."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )

    tok = char_tokenizer(SMOLVLM_SPECIAL, template=templates.SMOLVLM, bos="<|im_start|>", eos="<end_of_utterance>",
                         pad="<|im_end|>", unk="<|endoftext|>")
    seq_len = (image_size // 16 // 2) ** 2
    images = image_processor("Idefics3ImageProcessor", size={"longest_edge": 2 * image_size},
                             max_image_size={"longest_edge": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq_len,
                                  chat_template=templates.SMOLVLM)
    ids = token_ids(tok, pad_token_id="<|im_end|>", eos_token_id="<end_of_utterance>", bos_token_id="<|im_start|>")
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, rope_theta=1e5, **ids)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 2,
              "image_size": image_size, "patch_size": 16}
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, pad_token_id=ids["pad_token_id"],
                            **token_ids(tok, image_token_id="<image>"))
    model = seeded(lambda: Idefics3ForConditionalGeneration(config), seed)
    set_generation_ids(model, tok, ("<end_of_utterance>",), bos="<|im_start|>")
    return model, processor
