"""The "vllm" rollout engine: vLLM samples, grpokit trains. Options keep TRL's names (`use_vllm`, `vllm_mode`, ...).

Two modes (`vllm_mode`, listed in VLLM_MODES):
- colocate: a `vllm.LLM` inside the training process. Weights are pushed in memory with the worker's
  `reload_weights` (through `collective_rpc`), which re-runs vLLM's weight processing: on CPU every linear weight
  is repacked for oneDNN, so a direct per-parameter `load_weights` does not reach the kernels.
- server: a separate OpenAI-compatible `vllm serve` process (`grpo vllm-serve` starts one), local or remote.
  Requests go to /v1/completions with token-id prompts; weights go as one safetensors file written into a folder
  the server can read, then `POST /collective_rpc reload_weights {weights_path}` (the server must run with
  VLLM_SERVER_DEV_MODE=1, which grpo vllm-serve sets).
After every push the prefix cache is reset: cached prompt blocks hold keys and values of the old weights.

Weights arrive as a stream (`sync_weights(weights, version)`: grpokit/train/weights.py), every key under its
Hugging Face name, a PEFT adapter merged in, a tied weight under each name. A sharded policy's stream (FSDP2,
`weights.collective`) gathers each weight whole as it is read, so the trainer calls `sync_weights` on every process
at the same points. Colocate: each process feeds its own engine from the stream (reload_weights consumes it one
tensor at a time), so no process holds a second whole copy of the model beyond the engine's own. Server: every
process reads the stream; process 0 alone writes each tensor into the safetensors file as it arrives
(rollout/weights_file.py: the header first, from the stream's specs) and calls the server. A PEFT adapter on a
sharded base is refused before the model loads (grpokit/train/fsdp.py: run_options).

Sampling: every completion is its own request with a seed hashed from (seed, sample id), so a completion's
tokens do not depend on the rest of the batch (vLLM's per-request seeding), as with the local engine; unlike the
local engine, the draw is vLLM's, not bit-reproducible across vLLM versions or hardware. Log-probs are vLLM's
"processed_logprobs" (after temperature, top-k, top-p, min-p), the distribution it sampled from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from grpokit.registry import Registry
from grpokit.rng import rng_state, set_rng_state
from grpokit.rollout import weights_file
from grpokit.rollout.weights_file import WeightsFileError
from grpokit.rollout.engine import (
    EngineContext,
    Rollout,
    RolloutEngineError,
    RolloutRequest,
    SamplingParams,
    pad_rollout,
    register_rollout_engine,
)

INSTALL_HINT = 'install it with `pip install -e ".[vllm]"` (or `bash scripts/setup.sh dev,vllm`)'
# vLLM's CPU attention kernels exist for these head sizes only (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def request_seed(seed: int, sample_id: int) -> int:
    """A per-completion vLLM seed, a pure function of (run seed, global sample id), in [0, 2^31)."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _base_config(model: torch.nn.Module):
    return model.get_base_model().config if hasattr(model, "get_base_model") else model.config


def _check_stream(weights) -> None:
    if isinstance(weights, torch.nn.Module):
        raise TypeError("sync_weights takes a stream of the policy's weights, not the model: pass "
                        "grpokit.train.weights.named_weights(model) (what the trainer passes).")


def _stream(factory):
    """The first weight stream of an engine with its own copy (EngineContext.weights)."""
    if factory is None:
        raise RolloutEngineError("The vLLM engine starts from the policy's weights: its EngineContext needs "
                                 "weights=lambda: grpokit.train.weights.named_weights(model).")
    weights = factory()
    _check_stream(weights)
    return weights


def _head_size(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_model(model: torch.nn.Module) -> None:
    """Fail early, with the reason, where vLLM's CPU kernels cannot run this model."""
    if torch.cuda.is_available():
        return
    config = _base_config(model)
    head = _head_size(config)
    if head not in CPU_HEAD_SIZES:
        raise RolloutEngineError(
            f"vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; this model's is {head} "
            f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads). Use the local engine "
            "(use_vllm=False) for this model, or a model with a supported head size."
        )


@contextlib.contextmanager
def _engine_error(folder: Path):
    """A weights file that cannot be written, as the engine's error naming the folder."""
    try:
        yield
    except WeightsFileError as exc:
        raise RolloutEngineError(f"Could not write the weights for vLLM into {folder}: {exc}") from exc


def write_model_folder(weights, model: torch.nn.Module, folder: Path) -> None:
    """The folder vLLM starts from: the (base) model's config and generation config, and model.safetensors holding
    every key of the weight stream (tied ones too); under FSDP a collective, every process writing its own folder."""
    with _engine_error(folder):
        weights_file.write_model_folder(weights, _base_config(model), getattr(model, "generation_config", None),
                                        folder)


def write_weights(weights, folder: Path, keep: bool = True) -> None:
    """folder/model.safetensors from the weight stream, whole or not at all (`weights_file.write_safetensors`)."""
    with _engine_error(folder):
        weights_file.write_safetensors(weights, folder / "model.safetensors", keep)


def generation_kwargs_for_vllm(params: SamplingParams) -> dict[str, Any]:
    """generation_kwargs in vLLM's names: min_new_tokens -> min_tokens; do_sample (always True) dropped; other
    keys pass through unchanged."""
    extra = {k: v for k, v in (params.generation_kwargs or {}).items() if k != "do_sample"}
    if "min_new_tokens" in extra:
        extra["min_tokens"] = extra.pop("min_new_tokens")
    return extra


def _sampling_fields(params: SamplingParams, eos: list[int], seed: int) -> dict[str, Any]:
    return {
        "max_tokens": params.max_completion_length,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p or 0.0,
        "repetition_penalty": params.repetition_penalty,
        "seed": seed,
        "logprobs": 0,
        "stop_token_ids": list(eos),
        **generation_kwargs_for_vllm(params),
    }


@contextlib.contextmanager
def _preserved_rng():
    """vLLM seeds the global generators when it starts; the trainer's random streams must not move."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _kv_cache_bytes(config, max_model_length: int, sequences: int, dtype_bytes: int) -> int:
    """Bytes of KV cache for `sequences` concurrent sequences of max_model_length tokens, plus a quarter."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * _head_size(config) * dtype_bytes
    return max(32 * 2**20, int(1.25 * per_token * max_model_length * sequences))


def _quiet_rotary_reload(record: logging.LogRecord) -> bool:
    """Drop vLLM's warning that the rotary embedding got no weights on a reload: it holds only a computed cache."""
    return record.getMessage() != "RotaryEmbedding: Failed to load weights"


class VLLMColocateEngine:
    """vLLM in the training process; weights pushed in memory."""

    name = "vllm"

    def __init__(self, context: EngineContext) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core stays in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per weight push in the training log
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_quiet_rotary_reload)
        try:
            import vllm
        except ImportError as exc:
            raise RolloutEngineError(f"use_vllm=True needs vLLM, which is not installed: {INSTALL_HINT}.") from exc
        options = context.options
        check_model(context.model)
        if options.vllm_enable_sleep_mode and not torch.cuda.is_available():
            raise RolloutEngineError(
                "vllm_enable_sleep_mode=True needs a CUDA GPU (sleep mode offloads GPU memory); set it to False."
            )
        self.eos, self.pad = context.eos_token_ids, context.pad_token_id
        self.sleep_mode = options.vllm_enable_sleep_mode
        self.version: int | None = None
        self.folder = Path(tempfile.mkdtemp(prefix="grpokit-vllm-"))
        write_model_folder(_stream(context.weights), context.model, self.folder)
        # vLLM warms up its chat renderer with the tokenizer; without one it logs a traceback (harmless). It never
        # detokenises here (detokenize=False): ids in, ids out.
        context.tokenizer.save_pretrained(self.folder)
        dtype = "bfloat16" if options.bf16 else str(next(context.model.parameters()).dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(self.folder), dtype=dtype, logprobs_mode="processed_logprobs",
            max_model_len=context.max_model_length, seed=options.seed,
            tensor_parallel_size=options.vllm_tensor_parallel_size, enable_sleep_mode=self.sleep_mode,
        )
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = options.vllm_gpu_memory_utilization
        else:  # on CPU the KV cache is host memory: size it to the batch instead of a fraction of the machine
            sequences = int(context.extra.get("max_concurrent_sequences", 256))
            kwargs["kv_cache_memory_bytes"] = _kv_cache_bytes(
                _base_config(context.model), context.max_model_length, sequences, 2 if options.bf16 else 4
            )
            kwargs["enforce_eager"] = True  # no torch.compile warm-up on CPU
        try:
            with _preserved_rng():
                self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RolloutEngineError(f"vLLM could not start on this model ({type(exc).__name__}: {exc}).") from exc
        self.version = 0
        self._sleeping = False
        self._sampling_params = vllm.SamplingParams
        self._prompt = vllm.inputs.TokensPrompt

    def _wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    def sync_weights(self, weights, version: int) -> None:
        """The weight stream into the engine (reload_weights). A collective stream (FSDP): every process feeds its
        own engine from it, one whole tensor at a time, and reads to its end whatever the engine leaves."""
        _check_stream(weights)
        self._wake()
        if weights.collective:
            stream = iter(weights)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
            for _ in stream:  # whatever the engine left unread is still gathered: the others are in the same loop
                pass
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
        self.llm.reset_prefix_cache()
        self.version = version

    def generate(self, request: RolloutRequest) -> Rollout:
        self._wake()
        try:
            params = [
                self._sampling_params(detokenize=False, **_sampling_fields(request.params, self.eos, request_seed(request.seed, s)))
                for s in request.sample_ids.tolist()
            ]
        except (TypeError, ValueError) as exc:
            raise RolloutEngineError(f"vLLM rejected the sampling options (generation_kwargs?): {exc}") from exc
        prompts = [self._prompt(prompt_token_ids=list(p)) for p in request.prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [_chosen_logprobs(out.outputs[0]) for out in outputs] if request.return_logprobs else None
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._sleeping = True
        return pad_rollout(tokens, logprobs, self.eos, self.pad, self.version)

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            del llm
        shutil.rmtree(self.folder, ignore_errors=True)


def _chosen_logprobs(completion) -> list[float]:
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


class VLLMServerEngine:
    """A separate vLLM server, reached over HTTP; weights travel through a folder both sides can read."""

    name = "vllm"
    shared_across_processes = True  # every training process talks to the same server: one push is enough

    def __init__(self, context: EngineContext) -> None:
        options = context.options
        self.base_url = (options.vllm_server_base_url or f"http://{options.vllm_server_host}:{options.vllm_server_port}").rstrip("/")
        self.timeout = float(options.vllm_server_timeout)
        self.eos, self.pad = context.eos_token_ids, context.pad_token_id
        self.weights_dir = Path(options.vllm_server_weights_dir or Path(options.output_dir) / ".vllm-weights").absolute()
        self.version: int | None = None
        wait_for_server(self.base_url, self.timeout)
        models = self._call("GET", "/v1/models")
        self.model_name = models["data"][0]["id"]
        served_length = models["data"][0].get("max_model_len")
        if served_length is not None and served_length < context.max_model_length:
            raise RolloutEngineError(
                f"The vLLM server at {self.base_url} serves at most {served_length} tokens per sequence, but the "
                f"longest prompt plus max_completion_length is {context.max_model_length}; restart it with "
                f"--max-model-len {context.max_model_length} or more."
            )
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="grpokit-vllm")

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            if exc.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
                raise RolloutEngineError(
                    f"The vLLM server at {self.base_url} has no {path} endpoint: it must run with "
                    "VLLM_SERVER_DEV_MODE=1 for grpokit to push weights (`grpo vllm-serve` sets it)."
                ) from exc
            raise RolloutEngineError(f"The vLLM server at {self.base_url} answered {path} with {exc.code}: {detail}") from exc
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            raise RolloutEngineError(
                f"The vLLM server at {self.base_url} stopped answering ({path}: {getattr(exc, 'reason', exc)}); it may "
                "have died or be overloaded. Checkpoints already in output_dir are intact: restart the server and "
                "resume with --resume (train(resume_from_checkpoint=True)); vllm_server_timeout sets the wait."
            ) from exc

    def responsive(self) -> bool:
        """Whether the server answers GET /health within 5 s: a long call to a live server is progress (the
        asynchronous producer's heartbeat asks this before it calls the server hung)."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError):
            return False

    def sync_weights(self, weights, version: int) -> None:
        """The weight stream to the server through weights_dir. A collective stream (FSDP): every process reads it
        (the gathers), process 0 alone writes the file and calls the server."""
        _check_stream(weights)
        main = not weights.collective or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        write_weights(weights, self.weights_dir, keep=main)
        if main:
            self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(self.weights_dir)}})
            self._call("POST", "/reset_prefix_cache", {})
        self.version = version

    def _complete(self, prompt: list[int], fields: dict[str, Any]) -> tuple[list[int], list[float]]:
        body = {"model": self.model_name, "prompt": prompt, "return_token_ids": True, "n": 1, **fields}
        choice = self._call("POST", "/v1/completions", body)["choices"][0]
        return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])

    def generate(self, request: RolloutRequest) -> Rollout:
        jobs = [
            self.pool.submit(self._complete, list(p), _sampling_fields(request.params, self.eos, request_seed(request.seed, s)))
            for p, s in zip(request.prompt_ids, request.sample_ids.tolist())
        ]
        results = [job.result() for job in jobs]
        tokens = [r[0] for r in results]
        logprobs = [r[1] for r in results] if request.return_logprobs else None
        return pad_rollout(tokens, logprobs, self.eos, self.pad, self.version)

    def close(self) -> None:
        pool = self.__dict__.pop("pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def wait_for_server(base_url: str, timeout: float, poll: float = 1.0) -> None:
    """Poll GET /health until it answers 200, for at most `timeout` seconds; a clear error after that."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=min(10.0, max(1.0, timeout))) as response:
                if response.status == 200:
                    return
                last = f"status {response.status}"
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() + poll > deadline:
            raise RolloutEngineError(
                f"No vLLM server answered at {base_url}/health within vllm_server_timeout={timeout:g} s ({last}). "
                "Start one with `grpo vllm-serve --model PATH` (or raise vllm_server_timeout if it is still "
                "loading), check vllm_server_host / vllm_server_port / vllm_server_base_url, or use "
                "vllm_mode='colocate'."
            )
        time.sleep(poll)


# vllm_mode -> the engine class: the only list of the modes
VLLM_MODES = Registry("vllm_mode", import_paths=False)
VLLM_MODES.register("colocate", VLLMColocateEngine)
VLLM_MODES.register("server", VLLMServerEngine)


def check_vllm_options(c: Any) -> list[str]:
    """The vllm_* options of a GRPOConfig that uses this engine: a message for each value that cannot work."""
    problems = []
    if c.vllm_mode not in VLLM_MODES:
        problems.append(f"vllm_mode={c.vllm_mode!r} is not valid; {VLLM_MODES.choices_text()}.")
    if not 0 < c.vllm_server_port < 65536:
        problems.append(f"vllm_server_port={c.vllm_server_port} must be a TCP port (1-65535).")
    if not (c.vllm_server_timeout > 0 and math.isfinite(c.vllm_server_timeout)):
        problems.append(f"vllm_server_timeout={c.vllm_server_timeout} must be a positive number of seconds.")
    if not 0 < c.vllm_gpu_memory_utilization <= 1:
        problems.append(f"vllm_gpu_memory_utilization={c.vllm_gpu_memory_utilization} must be in (0, 1].")
    if c.vllm_tensor_parallel_size < 1:
        problems.append(f"vllm_tensor_parallel_size={c.vllm_tensor_parallel_size} must be at least 1.")
    if c.vllm_server_base_url is not None and not c.vllm_server_base_url.startswith(("http://", "https://")):
        problems.append(
            f"vllm_server_base_url={c.vllm_server_base_url!r} must start with http:// or https://, "
            "e.g. 'http://127.0.0.1:8000'."
        )
    return problems


@register_rollout_engine("vllm", check_options=check_vllm_options)
def vllm_engine(context: EngineContext):
    """vLLM in `vllm_mode` (a name in VLLM_MODES): in this process, or a server over HTTP."""
    try:
        engine_class = VLLM_MODES.resolve(context.options.vllm_mode)
    except ValueError as exc:
        raise RolloutEngineError(str(exc)) from exc
    return engine_class(context)
