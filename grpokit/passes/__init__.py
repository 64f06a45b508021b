"""The log-prob passes (training, old-policy, reference): completion-token log-probs of a batch from one forward.

    result = run_pass(model, Tokens(prompt_ids, prompt_mask, completion_ids, completion_mask), PassRequest(...))
    result.logprobs, result.entropies, result.loss                       # PassResult: (b, T), (b, T) or None

Three savings over "run the model on [prompt, completion] and log-softmax its logits", each exact (only the order
of floating-point operations differs):
1. Shared prompts. GRPO scores G completions of every prompt, so a batch holds each prompt G times; the prompt's
   keys and values do not depend on the completion (causal attention), so each distinct prompt runs once and its
   KV cache is copied to its G rows (`forward.shared_prompt_forward`).
2. No vocabulary-sized tensor. The model runs with its output head swapped for a pass-through and hands over last
   hidden states (b, T, H); the head is applied chunk by chunk with a recomputing backward (`heads`).
3. No padding (`packing`). Where the model takes a custom attention mask (or flash attention's sequence
   boundaries), the samples are laid end to end in rows, each distinct prompt once per row, and the head runs on
   the completion tokens only.
`dispatch.run_pass` picks the path; the request (`request.PassRequest`) says what the pass computes, and every
path returns one `PassResult`. Under FSDP2 the root unit (embeddings, final norm, head) stays gathered from its
forward to its backward (FSDP2's default for the root), so the head pass reads whole weights; the learner frees
it after a pass without backward.
"""

from grpokit.passes.dispatch import PACK_WHEN, completion_logprobs, padded_positions, run_pass
from grpokit.passes.forward import distinct_rows, output_head, packs, varlen
from grpokit.passes.heads import module_logprobs
from grpokit.passes.request import PassRequest, PassResult, Tokens

__all__ = ["PACK_WHEN", "PassRequest", "PassResult", "Tokens", "completion_logprobs", "distinct_rows",
           "module_logprobs", "output_head", "packs", "padded_positions", "run_pass", "varlen"]
