"""The collector: prompts -> episodes -> rewards -> dynamic sampling -> a ScoredBatch.

    batch = collector.collect(state)          # one generation batch, scored, with its advantages

One round: the sampler gives the same B prompts on every process; each prompt is repeated G times and every process
takes its slice; the engine (or the multi-turn loop over it, with tools and environments) completes them; the
reward functions score them; ONE gather gives every process the whole batch's rewards, step rewards and the
numbers telemetry needs, so groups are normalised whole. Dynamic sampling (DAPO) runs more rounds until enough
groups have signal and then moves the chosen completions between processes (one more gather). Engines are given
new weights lazily: right before a generation, when the learner's version moved since the last push. Building the
engine, the version it holds (`Pushed`) and joining the rollouts of several engine calls: engines.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.algorithms.process import batch_advantages
from grpokit.data import PromptSampler, is_conversational, render_prompt
from grpokit.rewards import RewardError, offsets_to_token_indices, score_completions, token_char_ends
from grpokit.rollout.engine import Rollout, RolloutRequest, SamplingParams, pad_rollout
from grpokit.rollout.environments import EnvironmentContractError, name_row
from grpokit.rollout.multiturn import Episodes
from grpokit.train.batches import ScoredBatch, TrainerState
from grpokit.train.comm import Comm
from grpokit.train.engines import Pushed, join_rollouts, wants_sampler_logprobs
from grpokit.train.setup import Setup

logger = logging.getLogger("grpokit")


@dataclass(frozen=True)
class Round:
    """One round of completions: rows (all N), this process's rollout, texts and prompt ids, and the exchanged
    values of all N: rewards (N, F), steps, lengths, truncated, tool_stats; failures and logged metrics summed or
    merged over processes; this process's log_extra columns."""

    rows: list[int]
    rollout: Rollout
    texts: list[str]
    prompt_ids: list[list[int]]
    rewards: torch.Tensor
    steps: list
    lengths: torch.Tensor
    truncated: torch.Tensor
    tool_stats: torch.Tensor
    failures: list[int]
    logged: dict[str, list[float]]
    log_extra: dict[str, list[Any]]
    vision: list | None = None  # this process's prompts' images (a vision-language run), else None


class Collector:
    """Owns the rollout engine, the prompt sampler and the reward functions' calls.

    policy: what the engine's weights come from, with `version` (an int the learner bumps on every change),
    `weights()` (a fresh weight stream to push: train/weights.py), `generating()` (the context the engine generates
    in) and `lockstep()` (whether generation calls must make as many forwards on every process). pushed: the
    engine's version as another collector of the same engine tracks it. `pulse(doing, engine)` is called around every
    engine and reward call (the asynchronous producer's heartbeat)."""

    def __init__(self, setup: Setup, comm: Comm, policy, engine, eos_ids: list[int], max_model_length: int,
                 pushed: Pushed | None = None) -> None:
        args = setup.args
        self.setup, self.comm, self.policy, self.engine = setup, comm, policy, engine
        self.pulse = lambda doing, engine=None: None
        self.eos_ids, self.max_model_length = eos_ids, max_model_length
        self.sampler = PromptSampler(len(setup.train_dataset), args.seed, args.shuffle_dataset)
        self.sampling = SamplingParams(
            args.max_completion_length, args.temperature, args.top_p, args.top_k, args.min_p,
            args.repetition_penalty, args.generation_kwargs,
        )
        self.pushed = pushed or Pushed(getattr(engine, "version", 0))  # the weights the engine has now
        self.wants_sampler_logprobs = wants_sampler_logprobs(args, args.resolved_rollout_engine)

    # ------------------------------------------------------------------ one batch
    def collect(self, state: TrainerState) -> ScoredBatch:
        """The next generation batch, scored. Bumps state.generations once per round (it offsets sample ids)."""
        args, started = self.setup.args, time.perf_counter()
        first = self.round(state)
        rounds, chosen, sampling_metrics = [first], None, {}
        if args.dynamic_sampling:
            rounds, chosen, sampling_metrics = self.dynamic_sampling(first, state)
        picked = self.compose(rounds, chosen) if chosen is not None else first
        advantages, stats = self.advantages(picked.rewards, picked.steps)
        n = len(picked.rows) // self.comm.size
        local = slice(self.comm.rank * n, (self.comm.rank + 1) * n)
        if torch.isnan(stats["reward"]).all():
            rows = picked.rows[local]
            logger.warning(
                "All reward functions returned None for the following kwargs: %s (and every other completion of "
                "the generation batch for step %d): every advantage is 0, so only the KL term (if beta > 0) "
                "moves the policy. Check that the reward functions apply to these prompts.",
                self.setup.train_dataset[rows[0]] if rows else {}, state.global_step + 1,
            )
        return ScoredBatch(
            rows=picked.rows, local=local, prompt_ids=picked.prompt_ids, rollout=picked.rollout, texts=picked.texts,
            vision=picked.vision,
            rewards=picked.rewards, steps=picked.steps, advantages=advantages, reward_stats=stats,
            lengths=picked.lengths, truncated=picked.truncated, tool_stats=picked.tool_stats,
            failures=picked.failures, logged_metrics=merge_logs([r.logged for r in rounds]),
            log_extra=merge_logs([r.log_extra for r in rounds]), sampling_metrics=sampling_metrics,
            generation_seconds=time.perf_counter() - started, weights_version=self.policy.version,
        )

    def advantages(self, rewards: torch.Tensor, steps: list, weights: torch.Tensor | None = None):
        """Advantages of a whole batch (N,) or (N, max_completion_length), and its reward statistics."""
        args = self.setup.args
        return batch_advantages(
            rewards, steps, self.setup.rewards.weights if weights is None else weights, args.num_generations,
            args.max_completion_length, args.multi_objective_aggregation, args.scale_rewards,
            args.advantage_estimator,
        )

    def round(self, state: TrainerState) -> Round:
        """Prompts for one generation batch, their completions (this process's slice) and every process's
        scores, exchanged in one gather."""
        setup, comm = self.setup, self.comm
        total = setup.geometry.completions_per_generation
        prompt_rows = self.sampler.take(total // setup.args.num_generations)
        rows = [r for r in prompt_rows for _ in range(setup.args.num_generations)]  # each prompt G times
        n = total // comm.size
        mine = rows[comm.rank * n : (comm.rank + 1) * n]
        sample_ids = torch.arange(comm.rank * n, (comm.rank + 1) * n) + state.generations * total
        episodes = self.episodes(setup.train_dataset, mine, [setup.prompt_ids[r] for r in mine], sample_ids,
                                 return_logprobs=self.wants_sampler_logprobs)
        state.generations += 1
        scored = self.score(setup.train_dataset, mine, episodes, state)
        rollout = episodes.rollout
        local = dict(error=message(scored.error), rewards=scored.rewards, steps=scored.steps, failures=scored.failures,
                     logged=scored.logs.metrics, lengths=rollout.model_mask.sum(-1), truncated=rollout.truncated,
                     tool_stats=episode_stats(episodes))
        everyone = comm.gather(local)
        raise_first_error([part["error"] for part in everyone], comm.rank, scored.error)
        return Round(
            rows, rollout, episodes.texts, episodes.prompt_ids,
            rewards=torch.cat([part["rewards"] for part in everyone]),
            steps=merge_steps([part["steps"] for part in everyone], n),
            lengths=torch.cat([part["lengths"] for part in everyone]),
            truncated=torch.cat([part["truncated"] for part in everyone]),
            tool_stats=torch.cat([part["tool_stats"] for part in everyone]),
            failures=[sum(values) for values in zip(*(part["failures"] for part in everyone))],
            logged=merge_logs([part["logged"] for part in everyone]), log_extra=scored.logs.extra,
            vision=episodes.vision,
        )

    # ------------------------------------------------------------------ dynamic sampling
    def dynamic_sampling(self, first: Round, state: TrainerState):
        """DAPO's dynamic sampling: keep the groups whose advantages are not all 0 and generate more rounds (each
        with fresh prompts) until a batch's worth is kept, or dynamic_sampling_max_rounds rounds ran; then fill
        the rest with the first groups dropped. Every process takes the same decisions (they read exchanged
        rewards). Returns the rounds, the chosen (round, group) pairs (None: exactly the first round) and the
        dynamic_sampling/* metrics."""
        args = self.setup.args
        groups = len(first.rows) // args.num_generations
        rounds, kept, flat = [first], [], []
        while True:
            advantages, _ = self.advantages(rounds[-1].rewards, rounds[-1].steps)
            informative = advantages.reshape(groups, -1).ne(0).any(-1).tolist()
            for g, useful in enumerate(informative):
                (kept if useful else flat).append((len(rounds) - 1, g))
            if len(kept) >= groups or len(rounds) >= args.dynamic_sampling_max_rounds:
                break
            rounds.append(self.round(state))
        chosen = kept[:groups]
        filled = groups - len(chosen)
        if filled:
            chosen += flat[:filled]
            logger.warning(
                "Dynamic sampling: only %d of %d groups had different rewards after %d rounds "
                "(dynamic_sampling_max_rounds); the batch is filled with %d groups whose rewards are all equal. "
                "The task may be too easy or too hard for the model now.", len(kept), groups, len(rounds), filled,
            )
        metrics = {
            "dynamic_sampling/rounds": len(rounds),
            "dynamic_sampling/dropped_groups": len(flat) - filled,
            "dynamic_sampling/extra_completions": (len(rounds) - 1) * len(first.rows),
            "dynamic_sampling/filled_with_flat": filled,
        }
        return rounds, None if chosen == [(0, g) for g in range(groups)] else chosen, metrics

    def compose(self, rounds: list[Round], chosen: list[tuple[int, int]]) -> Round:
        """A round made of the chosen (round, group) pairs; completions move between processes (one gather)."""
        comm, size = self.comm, self.setup.args.num_generations
        everyone = comm.gather([completion_rows(r) for r in rounds])  # per process: per round, its rows
        payloads = [[row for part in everyone for row in part[r]] for r in range(len(rounds))]
        picked = [(r, g * size + j) for r, g in chosen for j in range(size)]  # (round, global row)
        n = len(picked) // comm.size
        rows = [payloads[r][i] for r, i in picked[comm.rank * n : (comm.rank + 1) * n]]
        with_logprobs, multi_turn = rows[0][1] is not None, rows[0][4] is not None
        rollout = pad_rollout(
            [row[0] for row in rows], [row[1] for row in rows] if with_logprobs else None, self.eos_ids,
            self.setup.tokenizer.pad_token_id, tool_masks=[row[4] for row in rows] if multi_turn else None,
            truncated=[row[5] for row in rows],
        )
        steps = [
            None if all(r.steps[f] is None for r in rounds)
            else [None if rounds[r].steps[f] is None else rounds[r].steps[f][i] for r, i in picked]
            for f in range(len(rounds[0].steps))
        ]

        def pick(name: str) -> torch.Tensor:
            return torch.stack([getattr(rounds[r], name)[i] for r, i in picked])

        return Round(
            rows=[rounds[r].rows[i] for r, i in picked], rollout=rollout, texts=[row[2] for row in rows],
            prompt_ids=[row[3] for row in rows], rewards=pick("rewards"), steps=steps, lengths=pick("lengths"),
            truncated=pick("truncated"), tool_stats=pick("tool_stats"),
            failures=[sum(values) for values in zip(*(r.failures for r in rounds))], logged={}, log_extra={},
            vision=None if rounds[0].vision is None else [row[6] for row in rows],
        )

    # ------------------------------------------------------------------ episodes
    def generate(self, prompt_ids: list[list[int]], sample_ids: torch.Tensor, return_logprobs: bool = False,
                 params: SamplingParams | None = None, vision: list | None = None) -> Rollout:
        """Completions from the engine, after pushing the weights to it if they changed since its last push;
        vision: each prompt's images (a vision-language run), else None."""
        version = self.push_weights()
        params, seed, chunk = params or self.sampling, self.setup.args.seed, self.setup.args.max_inflight_tasks
        chunk = len(prompt_ids) if chunk < 1 else chunk
        parts = []
        for start in range(0, max(len(prompt_ids), 1), chunk):  # max_inflight_tasks completions per engine call
            rows = slice(start, start + chunk)
            self.pulse(f"generating {len(prompt_ids)} completions (engine "
                       f"{getattr(self.engine, 'name', type(self.engine).__name__)!r})", self.engine)
            with self.policy.generating():  # FSDP: the sharded policy's weights gathered for the call
                parts.append(self.engine.generate(RolloutRequest(
                    prompt_ids[rows], sample_ids[rows], params, seed, return_logprobs, self.policy.lockstep(),
                    None if vision is None else vision[rows])))
        self.pulse("generated")
        rollout = parts[0] if len(parts) == 1 else join_rollouts(parts, self.eos_ids, self.setup.tokenizer.pad_token_id)
        return rollout if rollout.weights_version is not None else dataclasses.replace(rollout, weights_version=version)

    def push_weights(self) -> int:
        """The learner's weights into the engine if they changed since its last push; their version. An engine
        shared by every process (a server) is pushed by process 0, the others wait; with a sharded policy (FSDP)
        every process takes part in gathering each parameter (a collective) and the engine keeps what it needs
        (grpokit/rollout/vllm_engine.py), so every process calls this at the same points: at the start of
        `episodes`, before any process-dependent number of generation calls."""
        version = self.policy.version
        if self.pushed.version != version:
            shared = getattr(self.engine, "shared_across_processes", False)  # one server for every process
            weights = self.policy.weights()
            self.pulse(f"pushing the weights of version {version} to the engine", self.engine)
            if not shared or self.comm.is_main or weights.collective:
                self.engine.sync_weights(weights, version)
            if shared:
                self.comm.barrier()
            self.pushed.version = version
        return version

    def episodes(self, dataset, rows: list[int], prompt_ids: list[list[int]], sample_ids: torch.Tensor,
                 return_logprobs: bool = False, where: str = "train_dataset") -> Episodes:
        """Completions of these dataset rows: one engine call, or multi-turn episodes with tools / environments.
        Multi-turn episodes run inside one `policy.generating()` block (FSDP: the policy gathered once for every
        turn, whatever number of calls each process makes)."""
        setup = self.setup
        self.push_weights()
        multiturn = setup.agent.multiturn
        vision = setup.visions(dataset, rows, where)
        if multiturn is None:
            rollout = self.generate(prompt_ids, sample_ids, return_logprobs, vision=vision)
            texts = setup.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            chat = is_conversational(dataset[rows[0]]["prompt"]) if rows else False
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
            ones = [1] * len(rows)
            return Episodes(rollout, prompt_ids, completions, texts, [0] * len(rows), [0] * len(rows), ones,
                            vision=vision)
        environments = prompts = None
        if setup.agent.environments is not None:
            columns = dataset[rows]
            row_dicts = [{k: v[i] for k, v in columns.items()} for i in range(len(rows))]
            placeholder = setup.placeholder_prompts and dataset is setup.train_dataset
            environments, observations = setup.agent.environments.reset(
                [{k: v for k, v in row.items() if k != "prompt"} for row in row_dicts] if placeholder else row_dicts,
                rows)
            prompts = [row["prompt"] if obs is None else with_observation(row["prompt"], obs)
                       for row, obs in zip(row_dicts, observations)]
            extended = [None if obs is None else self.tokenize_extended(prompt, row, v)
                        for prompt, row, obs, v in zip(prompts, row_dicts, observations, vision or [None] * len(rows))]
            prompt_ids = [ids if new is None else new[0] for ids, new in zip(prompt_ids, extended)]
            if vision is not None:
                vision = [v if new is None else new[1] for v, new in zip(vision, extended)]

        def generate(ids, sample_ids, params, images=None):
            return self.generate(ids, sample_ids, return_logprobs, params, vision=images)

        try:
            with self.policy.generating():  # FSDP: gathered once for all turns; the per-call blocks do nothing
                episodes = multiturn.run(generate, prompt_ids, sample_ids, self.sampling, environments,
                                         return_logprobs, vision)
        except EnvironmentContractError as exc:  # respond() raised: name its episode's row
            raise name_row(exc, environments or [], rows) from exc.__cause__
        if environments is not None:
            episodes.environments, episodes.prompts = environments, prompts
        episodes.vision = vision
        return episodes

    def tokenize_extended(self, prompt: Any, row: dict[str, Any], vision=None) -> tuple[list[int], Any]:
        """A prompt that reset() extended, tokenised and checked against max_prompt_length and the engine's
        context (the engine was sized for the dataset's prompts), and its images (`vision`: the row's, encoded
        again with the extended prompt so that per-token fields stay aligned; None without)."""
        args, tokenizer = self.setup.args, self.setup.tokenizer
        kwargs = self.setup.template_kwargs(row.get("environment"))
        if self.setup.images is not None:  # the row's images again, with the extended prompt
            ids, vision = self.setup.images.extended(prompt, row, kwargs, "a prompt reset() extended")
        else:
            text = render_prompt(tokenizer, prompt, kwargs)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        limit = args.max_prompt_length or self.max_model_length - args.max_completion_length
        if len(ids) > limit:
            raise EnvironmentContractError(
                f"reset() made a prompt {len(ids)} tokens long, more than "
                f"{'max_prompt_length' if args.max_prompt_length else 'the longest dataset prompt, which sized the engine'}"
                f" ({limit}); set max_prompt_length to the longest prompt reset() can make, or return shorter text."
            )
        return ids, vision

    # ------------------------------------------------------------------ scoring
    def score(self, dataset, rows: list[int], episodes: Episodes, state: TrainerState, funcs=None) -> "Scores":
        """This process's scores of `episodes`: rewards (n, F), failure counts, per function the step rewards as
        (token index, reward) lists (None for outcome functions), what the functions logged, and the RewardError
        that stopped scoring (raised by the caller after every process has reported). `funcs`: other functions
        with the reward contract (compute_metrics) instead of the reward functions."""
        columns = dataset[rows]  # {column: values of these rows}, rows may repeat
        prompts = columns.pop("prompt")
        if episodes.environments is not None:  # TRL: reward functions get each episode's environment, and the
            columns["environments"] = episodes.environments  # prompts as reset() extended them
            prompts = episodes.prompts
        rollout, logs = episodes.rollout, RewardLogs()
        completion_ids = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        funcs = funcs or self.setup.rewards.funcs
        self.pulse(f"scoring {len(rows)} completions with the reward functions")
        try:
            scores = score_completions(
                funcs, prompts, episodes.completions, completion_ids, columns, state,
                error_policy=self.setup.args.reward_error_policy, log_extra=logs.log_extra,
                log_metric=logs.log_metric, rows=rows,
            )
        except RewardError as exc:
            return Scores(torch.zeros(len(rows), len(funcs)), [0] * len(funcs), [None] * len(funcs), logs, exc)
        steps = [None if s is None else self.token_steps(s, completion_ids) for s in scores.steps]
        return Scores(scores.rewards.float(), list(scores.failures), steps, logs, None)

    def score_here(self, dataset, rows: list[int], episodes: Episodes, state: TrainerState, funcs=None):
        """Rewards (n, F) of completions every process scores alike (evaluation); a failure on any process stops
        every process with the same message."""
        scored = self.score(dataset, rows, episodes, state, funcs)
        raise_first_error(self.comm.gather(message(scored.error)), self.comm.rank, scored.error)
        return scored.rewards

    def token_steps(self, per_completion: list, completion_ids: list[list[int]]) -> list:
        """(character end offset, reward) step lists -> (token index, reward) lists, per completion."""
        out = []
        for pairs, ids in zip(per_completion, completion_ids):
            if not pairs or not ids:
                out.append(None)
                continue
            ends = offsets_to_token_indices(token_char_ends(self.setup.tokenizer, ids), [offset for offset, _ in pairs])
            out.append([(index, reward) for index, (_, reward) in zip(ends, pairs)])
        return out

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.sampler.state)


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor
    failures: list[int]
    steps: list
    logs: "RewardLogs"
    error: RewardError | None


class RewardLogs:
    """What reward functions log through their log_extra / log_metric arguments during one scoring call."""

    def __init__(self) -> None:
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        """A completions-log column: one value per completion of the batch the function scored."""
        self.extra.setdefault(str(column), []).extend(list(values))

    def log_metric(self, name: str, value: float) -> None:
        """A number logged as `name`, averaged with the other values logged under it for the same step."""
        self.metrics.setdefault(str(name), []).append(float(value))


def message(error: Exception | None) -> str | None:
    return None if error is None else str(error)


def raise_first_error(errors: list[str | None], rank: int, own: RewardError | None) -> None:
    """Raise this process's RewardError, else the first other process's message, naming the process."""
    if own is not None:
        raise own
    failed = [(r, message) for r, message in enumerate(errors) if message]
    if failed:
        r, message = failed[0]
        raise RewardError(f"Reward scoring failed on process {r}: {message}")


def merge_steps(parts: list[list], local_count: int) -> list:
    """Per function: None (an outcome function on every process) or the step lists of all N completions."""
    if len(parts) == 1:
        return parts[0]
    return [
        None if all(part[f] is None for part in parts)
        else [item for part in parts for item in (part[f] if part[f] is not None else [None] * local_count)]
        for f in range(len(parts[0]))
    ]


def merge_logs(parts: list[dict[str, list]]) -> dict[str, list]:
    """Dicts of lists -> one dict whose lists are concatenated in order."""
    merged: dict[str, list] = {}
    for part in parts:
        for name, values in part.items():
            merged.setdefault(name, []).extend(values)
    return merged


def completion_rows(r: Round) -> list[tuple]:
    """This process's completions of a round as plain rows: (tokens, log-probs, text, prompt ids, tool mask,
    truncated, prompt images), what compose moves between processes."""
    rollout = r.rollout
    mask = rollout.completion_mask.bool()
    logprobs, tool_mask = rollout.logprobs, rollout.tool_mask
    return [
        (rollout.completion_ids[i][mask[i]].tolist(), None if logprobs is None else logprobs[i][mask[i]].tolist(),
         r.texts[i], r.prompt_ids[i], None if tool_mask is None else tool_mask[i][mask[i]].tolist(),
         bool(rollout.truncated[i]), None if r.vision is None else r.vision[i])
        for i in range(len(r.texts))
    ]


def episode_stats(episodes: Episodes) -> torch.Tensor:
    """(n, 4) per completion: tool calls, failed calls, model turns, tokens written by tools and environments."""
    rollout = episodes.rollout
    tool_tokens = (rollout.completion_mask - rollout.model_mask).sum(-1).tolist()
    return torch.tensor([episodes.tool_calls, episodes.tool_failures, episodes.turns, tool_tokens], dtype=torch.long).T


def with_observation(prompt: Any, observation: str) -> Any:
    """A prompt with reset()'s text appended: to the string, or to the last message's content (a string, None, or
    a list of content parts, which gets a text part)."""
    if isinstance(prompt, str):
        return prompt + observation
    last = dict(prompt[-1])
    content = last.get("content")
    if isinstance(content, list):
        last["content"] = content + [{"type": "text", "text": observation}]
    else:
        last["content"] = (content or "") + observation
    return list(prompt[:-1]) + [last]
