"""FSDP2 checks on a tiny Qwen2, run by `torchrun --nproc_per_node 2` (tests/test_fsdp2.py): each check compares the
sharded model against an unsharded copy of the same weights in the same process, and rank 0 prints one JSON line
of results. usage: fsdp_checks.py (gloo, CPU)"""

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from grpokit.config.fsdp import FSDPOptions  # noqa: E402
from grpokit.passes import completion_logprobs  # noqa: E402
from grpokit.rollout.engine import SamplingParams  # noqa: E402
from grpokit.rollout.generate import generate_completions, left_pad  # noqa: E402
from grpokit.tiny import tiny_model_and_tokenizer  # noqa: E402
from grpokit.train.fsdp import clip_gradients, full_state_dict, load_full_state, lockstep_decoding, shard  # noqa: E402


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def sharded_shapes(model) -> dict:
    """Global and local shapes of two parameters; every parameter a DTensor."""
    q = model.model.layers[0].self_attn.q_proj.weight
    embed = model.model.embed_tokens.weight
    return {"all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "q_proj": [list(q.shape), list(q.to_local().shape)],
            "embed": [list(embed.shape), list(embed.to_local().shape)]}


def generation(model, plain, tokenizer, rank: int) -> dict:
    """Each process samples its own rows (rank 1 three times as many; with seed 4 rank 0's all end after 4 tokens,
    rank 1's run to 24, so rank 0 decodes padding in lockstep): sharded == unsharded."""
    prompts = [tokenizer(f"{i}+{i}=")["input_ids"] for i in range(2 + 4 * rank)]
    sample_ids = torch.arange(len(prompts)) + 100 * rank
    params = SamplingParams(max_completion_length=24, temperature=1.5)
    with lockstep_decoding(model):
        ours = generate_completions(model, tokenizer, prompts, sample_ids, params, seed=4, return_logprobs=True,
                                    lockstep=True, sharded=True)
    theirs = generate_completions(plain, tokenizer, prompts, sample_ids, params, seed=4, return_logprobs=True)
    lengths = [int(n) for n in ours.completion_mask.sum(-1)]
    return {"same_tokens": bool(torch.equal(ours.completion_ids, theirs.completion_ids)),
            "logprob_diff": max_difference(ours.logprobs, theirs.logprobs), "longest": max(lengths),
            "root_resharded": isinstance(model.lm_head.weight, DTensor)}


def logprobs_and_gradients(model, plain, tokenizer, rank: int, world: int) -> dict:
    """The fused-head training pass (shared prompts: several forwards before one backward) on each process's own
    batch: log-probs equal, and FSDP's averaged sharded gradients equal the unsharded gradients averaged by hand;
    the global gradient norm too."""
    prompt = tokenizer(f"{rank}+{rank}=")["input_ids"]
    prompt_ids, prompt_mask = left_pad([prompt] * 4, 0)
    completion_ids = torch.randint(2, 20, (4, 6), generator=torch.Generator().manual_seed(rank))
    completion_mask = torch.ones_like(completion_ids)
    results = {}
    for name, module in (("sharded", model), ("plain", plain)):
        logp, _ = completion_logprobs(module, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
        (logp * torch.linspace(-1, 1, 6)).sum().backward()
        results[name] = logp.detach()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
    sharded_norm = clip_gradients(model.parameters(), float("inf"))
    worst = max(max_difference(p.grad.full_tensor(), grads[n]) for n, p in model.named_parameters())
    return {"logprob_diff": max_difference(results["sharded"], results["plain"]), "grad_diff": worst,
            "norm_diff": max_difference(sharded_norm, plain_norm), "head_grad_nonzero":
            bool(model.lm_head.weight.grad.full_tensor().abs().sum() > 0)}


def state_dict_round_trip(model, plain) -> dict:
    """full_state_dict gathers the unsharded weights on rank 0 (the tied head one tensor under both names, as the
    weight stream gives it); load_full_state puts them back."""
    state = full_state_dict(model)
    expected = plain.state_dict()
    same = all(max_difference(state[k], expected[k]) == 0 for k in state) if state else None
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full_state(model, dict(state))  # it replaces the values of the dict it is given
    restored = full_state_dict(model)
    return {"gathered_equal": same, "keys": sorted(state)[:2] if state else None,
            "tied_alias_shared": state["lm_head.weight"] is state["model.embed_tokens.weight"] if state else None,
            "restored_equal": all(torch.equal(restored[k], state[k]) for k in state) if state else None}


def bf16_pass(tokenizer) -> dict:
    """bf16 parameters gathered over gloo with fp32 gradient reduction: log-probs near the fp32 ones."""
    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=1)
    plain = copy.deepcopy(model)
    shard(model, FSDPOptions(), torch.device("cpu"), bf16=True)
    prompt_ids, prompt_mask = left_pad([tokenizer("3+3=")["input_ids"]] * 2, 0)
    completion_ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    ours, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids))
    ours.sum().backward()
    theirs, _ = completion_logprobs(plain, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids))
    grad = model.model.layers[0].mlp.up_proj.weight.grad
    return {"logprob_diff": max_difference(ours, theirs), "grad_dtype": str(grad.dtype),
            "param_dtype": str(model.model.layers[0].mlp.up_proj.weight.dtype)}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
    plain = copy.deepcopy(model)
    shard(model, FSDPOptions(), torch.device("cpu"), bf16=False)
    results = {"shapes": sharded_shapes(model), "generation": generation(model, plain, tokenizer, rank)}
    results["generation"]["longest_per_rank"] = [None] * world
    dist.all_gather_object(results["generation"]["longest_per_rank"], results["generation"]["longest"])
    results["training_pass"] = logprobs_and_gradients(model, plain, tokenizer, rank, world)
    results["state_dict"] = state_dict_round_trip(model, plain)
    results["bf16"] = bf16_pass(tokenizer)
    if rank == 0:
        print("RESULTS " + json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
