"""User code that misbehaves: tools that hang, spin, leak, fork or exit; a calculator fed quadratic work;
environments and reward functions that call sys.exit() or raise other BaseExceptions (issue 24, items 5-7).

Each test is written as the attack is: the hostile function is called as the trainer calls it, and the test checks
what the trainer is left with (threads, processes, memory, exit status, message, checkpoint)."""

import os
import sys
import threading
import time

import pytest

from grpokit.tools import ToolCall, Toolbox, calculator
from grpokit.tools import worker as tool_worker

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="tool workers use /proc and prctl (Linux)")


def _error(result) -> str:
    import json

    assert result.failed, result
    return json.loads(result.content)["error"]


def _resident_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _running_descendants(patience: float = 5.0) -> list[str]:
    """This process's descendants that are not idle (R, D, or zombies), after waiting up to `patience` seconds
    for them to settle (a worker that just answered is still on its way back to its read)."""
    deadline = time.monotonic() + patience
    while (busy := _busy_descendants()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return busy


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for tid in os.listdir(f"/proc/{parent}/task") if os.path.exists(f"/proc/{parent}/task") else []:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    children = [int(p) for p in fh.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def _busy_descendants() -> list[str]:
    states = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("S", "I"):
            states.append(f"{pid}:{state}")
    return states


# ---------------------------------------------------------------- 5b: the calculator's work is bounded up front
def _balanced_product(count: int) -> str:
    terms = ["99999999"] * count
    while len(terms) > 1:
        terms = [f"({terms[i]}*{terms[i + 1]})" if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def test_the_balanced_product_attack_is_refused_without_computing_it():
    attack = _balanced_product(5300)  # ~58k characters: 36 s of CPU before
    started = time.process_time()
    with pytest.raises(ValueError, match="longer than 2000 characters"):
        calculator(attack)
    short = _balanced_product(130)  # under the length cap: refused by size, before the big products
    assert len(short) < 2000
    with pytest.raises(ValueError, match="more than 1000 digits"):
        calculator(short)
    for expression in ("9" * 999 + "*" + "9" * 999, "(2**3000)**2", "(10**999)//3*(10**999)", "9**9**9**9"):
        with pytest.raises(ValueError, match="more than 1000 digits|longer than"):
            calculator(expression)
    with pytest.raises(ValueError, match="more than 500 numbers"):
        calculator("1+" * 600 + "1")
    assert time.process_time() - started < 5  # all of it: milliseconds (generous for a loaded machine)
    assert calculator("10**999+1") == str(10**999 + 1) and calculator(_balanced_product(8)) == str(99999999**8)


# ---------------------------------------------------------------- 6: tools cannot outlive their timeout
LEAKED = []


def spin(x: int) -> str:
    """Spin forever.

    Args:
        x: Ignored.
    """
    while True:
        pass


def sleep(x: int) -> str:
    """Sleep for a long time.

    Args:
        x: Ignored.
    """
    time.sleep(3600)
    return "woke"


def leak(mb: int) -> str:
    """Keep `mb` megabytes more on every call.

    Args:
        mb: How many.
    """
    LEAKED.append(bytearray(mb * 2**20))
    return str(len(LEAKED))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def test_spinning_and_sleeping_tools_leave_nothing_running_after_their_timeout():
    box = Toolbox([spin, sleep, add], timeout=0.5)
    threads = threading.active_count()
    for _ in range(3):
        spun, slept, added = box.run([ToolCall("spin", {"x": 1}), ToolCall("sleep", {"x": 1}),
                                      ToolCall("add", {"a": 1, "b": 2})])
        assert _error(spun) == "tool 'spin' did not return within 0.5 s"
        assert _error(slept) == "tool 'sleep' did not return within 0.5 s"
        assert added.content == "3"
        assert threading.active_count() == threads  # no thread was left behind in the trainer
        assert _running_descendants() == []  # the spinning worker was killed, not left to eat a core
    box.worker.close()
    assert _descendants(os.getpid()) == []


def test_inline_tools_run_in_the_trainers_memory_and_process_tools_do_not():
    seen = []

    def remember(x: int) -> int:
        """Remember x.

        Args:
            x: A number.
        """
        seen.append((x, os.getpid()))
        return x

    call = ToolCall(name="remember", arguments={"x": 7})
    assert Toolbox([remember]).run([call])[0].content == "7" and seen == []  # the worker's list, not ours
    assert Toolbox([remember], isolation="inline").run([call])[0].content == "7"
    assert seen == [(7, os.getpid())]  # the trainer's own process and memory
    with pytest.raises(ValueError, match="tool_isolation='thread' is not valid; choose one of: process, inline"):
        Toolbox([remember], isolation="thread")


def test_a_leaking_tool_called_repeatedly_does_not_grow_the_trainer_and_its_worker_is_replaced(monkeypatch, tmp_path):
    import mmap

    monkeypatch.setattr(tool_worker, "MAX_WORKER_GROWTH", 200 * 2**20)
    # A trainer with 600 MB of file-backed memory resident (as mmapped weights and libraries are in a real run),
    # which a forked worker does not start with: its growth must be measured from its own size.
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as fh:
        fh.truncate(600 * 2**20)
    with open(weights, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    assert sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE)) == 0  # every page resident
    box = Toolbox([leak], timeout=30)
    before, workers, peak = _resident_mb(), set(), 0.0
    for _ in range(11):  # 550 MB in all, as in the issue
        (result,) = box.run([ToolCall("leak", {"mb": 50})])
        assert not result.failed
        if box.worker.pid is not None:
            workers.add(box.worker.pid)
            peak = max(peak, _resident_mb(box.worker.pid))
    assert _resident_mb() - before < 50  # the trainer kept none of it (it grew by 549 MB before)
    assert len(workers) >= 2 and peak - before < 200 + 100  # the worker was replaced past its growth limit
    assert LEAKED == []  # the trainer's own list never saw an append
    box.worker.close()
    mapped.close()


def test_a_tool_that_forks_a_daemon_or_leaves_a_thread_leaves_no_process():
    def daemon(x: int) -> str:
        """Start a daemon that outlives the call.

        Args:
            x: Ignored.
        """
        if os.fork() == 0:
            os.setsid()  # leaves the worker's process group
            if os.fork() == 0:
                while True:
                    pass
            os._exit(0)
        return "started"

    def background(x: int) -> str:
        """Start a spinning thread and return.

        Args:
            x: Ignored.
        """
        threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
        return "started"

    box = Toolbox([daemon, background, add], timeout=5)
    assert [r.content for r in box.run([ToolCall("daemon", {"x": 1})])] == ["started"]
    assert _descendants(box.worker.pid) == []  # the daemon was killed when the call returned
    first = box.worker.pid
    assert [r.content for r in box.run([ToolCall("background", {"x": 1})])] == ["started"]
    assert box.worker.pid is None and first not in _descendants(os.getpid())  # replaced: thread gone
    assert box.run([ToolCall("add", {"a": 2, "b": 2})])[0].content == "4"
    assert _running_descendants() == []
    box.worker.close()


def test_a_tool_that_exits_or_kills_its_process_is_an_error_and_the_next_call_works():
    def leave(how: str) -> str:
        """End the process.

        Args:
            how: exit, _exit or kill.
        """
        import signal

        if how == "exit":
            sys.exit(0)
        if how == "_exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    box = Toolbox([leave, add], timeout=5)
    results = box.run([ToolCall("leave", {"how": h}) for h in ("exit", "_exit", "kill")]
                      + [ToolCall("add", {"a": 1, "b": 1})])
    assert _error(results[0]) == "SystemExit: 0"
    assert _error(results[1]) == "tool 'leave' ended its process without returning a result (exit status 3)"
    assert _error(results[2]) == "tool 'leave' ended its process without returning a result (killed by SIGKILL)"
    assert results[3].content == "2"
    box.worker.close()


# ---------------------------------------------------------------- 7: user code that exits, through the trainer
import signal  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402

from grpokit import GRPOConfig, GRPOTrainer  # noqa: E402
from grpokit.rewards import RewardError  # noqa: E402
from grpokit.rollout.environments import EnvironmentContractError  # noqa: E402
from helpers import register_test_formats  # noqa: E402

register_test_formats()
EPISODES_PER_STEP = 8  # per_device_train_batch_size below: the first call of step 2 is call 9


class Abort(BaseException):
    """A custom BaseException, as KeyboardInterrupt is one, that user code may raise."""


def _args(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4,
                   per_device_train_batch_size=EPISODES_PER_STEP, max_completion_length=16, learning_rate=1e-3,
                   logging_steps=1, save_strategy="no", report_to=[], tool_call_format="test_every_turn",
                   max_tool_calling_iterations=1, disable_tqdm=True)
    options.update(overrides)
    return GRPOConfig(**options)


def _dataset():
    return datasets.Dataset.from_list([{"prompt": f"q{i}", "idx": i} for i in range(12)])


def zero(completions, **kwargs):
    return [0.0] * len(completions)


def _checkpoints(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))


@pytest.mark.parametrize("exit_with", [lambda: sys.exit(0), lambda: (_ for _ in ()).throw(GeneratorExit("gone")),
                                       lambda: (_ for _ in ()).throw(Abort("custom"))],
                         ids=["SystemExit", "GeneratorExit", "custom BaseException"])
def test_a_reset_that_exits_on_one_row_stops_training_naming_the_method_and_the_row(tmp_path, tiny_model_dir,
                                                                                     exit_with):
    seen = []

    class Exits:
        def reset(self, idx, **row):
            seen.append(idx)
            if len(seen) == EPISODES_PER_STEP + 1:  # the first episode of step 2
                exit_with()

    trainer = GRPOTrainer(tiny_model_dir, zero, args=_args(tmp_path), train_dataset=_dataset(),
                          environment_factory=Exits)
    with pytest.raises(EnvironmentContractError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "Exits.reset() raised " in message and "which would have ended the trainer" in message
    assert f"on dataset row {seen[-1]} " in message
    assert trainer.state.global_step == 1 and _checkpoints(tmp_path) == ["checkpoint-1"]  # step 1 kept


def test_a_respond_that_exits_names_its_row(tmp_path, tiny_model_dir):
    class Quits:
        def reset(self, idx, **row):
            self.idx = idx

        def respond(self, text: str) -> str:
            sys.exit(f"bye from {self.idx}")

    trainer = GRPOTrainer(tiny_model_dir, zero, args=_args(tmp_path, max_steps=1), train_dataset=_dataset(),
                          environment_factory=Quits)
    with pytest.raises(EnvironmentContractError, match=r"Quits.respond\(\) raised SystemExit: bye from (\d+) .* on "
                                                       r"dataset row \1$"):
        trainer.train()


@pytest.mark.parametrize("policy", ["raise", "none"])
def test_a_reward_function_that_exits_on_its_second_call_stops_with_its_name_rows_and_a_checkpoint(
        tmp_path, tiny_model_dir, policy):
    calls = []

    def quits(completions, idx, **kwargs):
        calls.append(list(idx))
        if len(calls) == 2:
            sys.exit(0)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(tiny_model_dir, quits, args=_args(tmp_path, reward_error_policy=policy),
                          train_dataset=_dataset())
    with pytest.raises(RewardError, match=r"reward function 'quits' raised SystemExit: 0, which would have ended "
                                          r"the trainer\n  while scoring samples 0\.\.7 \(dataset rows ") as caught:
        trainer.train()
    assert f"(dataset rows {', '.join(map(str, calls[1]))})" in str(caught.value)
    assert trainer.state.global_step == 1 and _checkpoints(tmp_path) == ["checkpoint-1"]


def test_a_keyboard_interrupt_from_user_code_stops_like_ctrl_c_and_replaced_handlers_are_put_back(
        tmp_path, tiny_model_dir):
    handlers = []

    def meddles(completions, **kwargs):
        handlers.append(signal.getsignal(signal.SIGINT))
        if len(handlers) == 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C would no longer stop the run
        if len(handlers) == 3:
            raise KeyboardInterrupt
        return [0.0] * len(completions)

    previous = signal.getsignal(signal.SIGINT)
    trainer = GRPOTrainer(tiny_model_dir, meddles, args=_args(tmp_path), train_dataset=_dataset())
    result = trainer.train()
    assert handlers[1] is not signal.SIG_IGN and handlers[1] is handlers[0]  # the trainer's, put back
    assert result.interrupted == "SIGINT" and trainer.state.global_step == 2
    assert _checkpoints(tmp_path) == ["checkpoint-2"]
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_tool_that_exits_is_an_error_the_model_reads_and_training_goes_on(tmp_path, tiny_model_dir):
    def echo(text: str) -> str:
        """Leave.

        Args:
            text: Ignored.
        """
        sys.exit(0)

    trainer = GRPOTrainer(tiny_model_dir, zero, args=_args(tmp_path, max_steps=2), train_dataset=_dataset(),
                          tools=[echo])
    trainer.train()
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "model.safetensors").is_file()
    assert trainer.state.log_history[0]["tools/failure_frequency"] == 1.0


HOSTILE = '''
import sys

calls = []


def quits(completions, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        sys.exit(0)
    return [0.0] * len(completions)


class ExitsOnReset:
    count = 0

    def reset(self, **row):
        ExitsOnReset.count += 1
        if ExitsOnReset.count == 9:
            sys.exit(0)
'''


@pytest.mark.parametrize("hostile, expected", [
    ("reward_funcs: ['hostile:quits']", r"reward function 'quits' raised SystemExit: 0.*\(dataset rows \d+"),
    ("reward_funcs: ['helpers:short']\nenvironment_factory: hostile:ExitsOnReset\n"
     "tool_call_format: test_every_turn\nmax_tool_calling_iterations: 1",
     r"ExitsOnReset.reset\(\) raised SystemExit: 0 .* on dataset row \d+"),
], ids=["reward function", "environment reset"])
def test_grpo_train_exits_nonzero_naming_the_function_and_row_with_the_trained_step_saved(
        tmp_path, tiny_model_dir, hostile, expected):
    import re

    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "register.py").write_text("from helpers import register_test_formats\nregister_test_formats()\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(16)))
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {tiny_model_dir}\ndataset: {data}\n{hostile}\noutput_dir: {out}\nmax_steps: 3\n"
                      f"num_generations: 4\nper_device_train_batch_size: {EPISODES_PER_STEP}\n"
                      "max_completion_length: 8\ndisable_tqdm: true\nsave_strategy: 'no'\nreport_to: []\n")
    root = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(root.parent), str(root)]))
    code = "import register, sys; from grpokit.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen([sys.executable, "-c", code, "train", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=600)
    finally:  # the run and everything it started
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode not in (0, None), stderr[-3000:]
    assert re.search(expected, stderr, re.DOTALL), stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"], stderr[-3000:]
