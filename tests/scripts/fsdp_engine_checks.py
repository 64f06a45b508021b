"""FSDP2 checks of what the engines read from a sharded policy, run by `torchrun --nproc_per_node 2`
(tests/test_fsdp2_engines.py); each compares against an unsharded copy of the same weights in the same process, and
rank 0 prints one JSON line of results. usage: fsdp_engine_checks.py OUTPUT_DIR (gloo, CPU)

- push: named_weights (the colocate push) and write_weights (the server's file; process 0 keeps it) give
  every state-dict key, tied head included, equal to the unsharded model's;
- generation: inside gathered_for_generation the processes make different numbers of generation calls (rank r makes
  1 + 2r), with no lockstep, and each call's tokens and log-probs equal the unsharded model's.
"""

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from grpokit.config.fsdp import FSDPOptions  # noqa: E402
from grpokit.rollout.engine import SamplingParams  # noqa: E402
from grpokit.rollout.generate import generate_completions  # noqa: E402
from grpokit.rollout.vllm_engine import write_model_folder, write_weights  # noqa: E402
from grpokit.tiny import tiny_model_and_tokenizer  # noqa: E402
from grpokit.train.fsdp import gathered_for_generation, is_gathered, shard  # noqa: E402
from grpokit.train.weights import named_weights  # noqa: E402


def same(found: dict, expected: dict) -> dict:
    """Keys equal, every tensor bit-equal (shape and dtype too)."""
    return {"keys_equal": sorted(found) == sorted(expected),
            "tensors_equal": all(k in found and found[k].dtype == v.dtype and torch.equal(found[k], v)
                                 for k, v in expected.items())}


def push(model, plain, folder: Path, rank: int) -> dict:
    expected = {k: v.detach() for k, v in plain.state_dict().items()}
    streamed = dict(named_weights(model))
    write_weights(named_weights(model), folder / f"server-{rank}", keep=rank == 0)
    # every process its own folder (the colocate engine)
    write_model_folder(named_weights(model), model, folder / f"colocate-{rank}")
    result = {"has_tied_head": "lm_head.weight" in streamed, "streamed": same(streamed, expected),
              "colocate_file": same(load_file(folder / f"colocate-{rank}" / "model.safetensors"), expected),
              "config_written": (folder / f"colocate-{rank}" / "config.json").is_file()}
    server_file = folder / f"server-{rank}" / "model.safetensors"
    result["server_file"] = same(load_file(server_file), expected) if rank == 0 else server_file.exists()
    return result


def generation(model, plain, tokenizer, rank: int) -> dict:
    params = SamplingParams(max_completion_length=12, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                            repetition_penalty=1.0, generation_kwargs={})
    prompts = [tokenizer(f"{rank}+{rank}=")["input_ids"]] * 2
    equal, diffs = True, []
    with gathered_for_generation(model, True):
        for call in range(1 + 2 * rank):
            ids = torch.tensor([100 * rank + 10 * call, 100 * rank + 10 * call + 1])
            ours = generate_completions(model, tokenizer, prompts, ids, params, seed=3, return_logprobs=True,
                                        sharded=True)
            theirs = generate_completions(plain, tokenizer, prompts, ids, params, seed=3, return_logprobs=True)
            equal &= torch.equal(ours.completion_ids, theirs.completion_ids)
            diffs.append((ours.logprobs - theirs.logprobs).abs().max().item())
        gathered_inside = is_gathered(model)
    return {"calls": 1 + 2 * rank, "same_tokens": equal, "logprob_diff": max(diffs),
            "gathered_inside": gathered_inside, "gathered_after": is_gathered(model)}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(sys.argv[1])
    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
    plain = copy.deepcopy(model)
    shard(model, FSDPOptions(), torch.device("cpu"), bf16=False)
    results = {"push": push(model, plain, folder, rank), "generation": generation(model, plain, tokenizer, rank)}
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        print("RESULTS " + json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
