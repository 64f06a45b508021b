"""grpokit.observe.health on hand-made metric curves: each alarm fires on its planted problem, at the step it appears,
with its evidence, and stays silent on a healthy run (and on the demo's healthy pattern of noisy KL)."""

import json
import math
import random
import time

import pytest

from grpokit.observe import health
from grpokit.observe.health import ALARM_TITLES, Alarm, HealthMonitor, History, check_run

STEPS = 60


def healthy_rows(n=STEPS, seed=0):
    """A run that learns: reward up, entropy down gently, KL ramping from 0 then noisy, lengths steady."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        t = step / n
        kl = 0.03 * min(1.0, step / 8) ** 2 * (1 + 0.5 * rng.random())
        rows.append({
            "step": step, "epoch": t, "reward": 0.2 + 0.6 * t + 0.05 * rng.random(), "reward_std": 0.4,
            "rewards/correct/mean": 0.2 + 0.6 * t, "rewards/correct/std": 0.4 + 0.05 * rng.random(),
            "rewards/format/mean": 0.9, "rewards/format/std": 0.2 + 0.05 * rng.random(),
            "frac_reward_zero_std": 0.1 + 0.3 * t * rng.random(),
            "completions/mean_length": 100 + 10 * rng.random(), "completions/min_length": 20.0,
            "completions/max_length": 180.0, "completions/clipped_ratio": 0.02 * rng.random(),
            "kl": kl, "loss": 0.04 * kl + 0.05 * (rng.random() - 0.5), "entropy": 0.8 - 0.4 * t + 0.02 * rng.random(),
            "clip_ratio/region_mean": 0.0, "grad_norm": 0.5 + rng.random(), "learning_rate": 1e-6, "step_seconds": 2.0,
        })
    return rows


def with_curve(rows, key, values):
    """A copy of rows with `key` set to values[i] on row i (None removes nothing: it logs None)."""
    return [{**row, key: value} for row, value in zip(rows, values)]


def kinds(alarms):
    return [a.kind for a in alarms]


def only(alarms, kind):
    found = [a for a in alarms if a.kind == kind]
    assert len(found) == 1, alarms
    return found[0]


def first_step_firing(rows, kind, **run):
    monitor = HealthMonitor(**run)
    for row in rows:
        if any(a.kind == kind for a in monitor.update(row)):
            return row["step"]
    return None


def test_healthy_run_is_silent_with_and_without_beta():
    for seed in range(5):
        rows = healthy_rows(seed=seed)
        assert check_run(rows) == []
        assert check_run(rows, beta=0.04, reward_weights={"correct": 1.0, "format": 1.0}) == []


def test_empty_and_odd_rows_do_not_crash():
    assert check_run([]) == []
    odd = [{"step": 1, "entropy": None, "kl": float("nan"), "reward": float("inf"), "note": "text", "flag": True},
           {"entropy": 0.5}, {"step": 3, "eval/reward": None}]
    assert check_run(odd) == []
    history = History.from_rows(odd)
    assert history.get("entropy") == [(1, 0.5)]  # a row without step belongs to the last step seen
    assert history.get("kl") == [] and history.get("flag") == [] and history.get("note") == []


def test_entropy_collapse_fires_when_entropy_falls_to_a_tenth():
    rows = with_curve(healthy_rows(), "entropy", [0.8 * 0.9**s for s in range(STEPS)])
    alarm = only(check_run(rows), "entropy_collapse")
    # early level: median of the first 5 values 0.8 * 0.9**2; now: median of the last 3 -> first step <= 10%
    early = 0.8 * 0.9**2
    expected = next(s for s in range(8, STEPS + 1) if 0.8 * 0.9 ** (s - 2) <= 0.1 * early)
    assert alarm.step == expected and alarm.metric == "entropy"
    assert [e[0] for e in alarm.evidence] == [1, 2, 3, 4, 5, expected - 2, expected - 1, expected]
    assert "nats/token" in alarm.message and "entropy_coef" in alarm.advice


def test_entropy_floor_fires_for_a_low_entropy_model_that_falls_further():
    values = [0.03] * 10 + [0.004] * 10  # 13% of its early level: not a tenth, but below the floor
    rows = with_curve(healthy_rows(20), "entropy", values)
    assert only(check_run(rows), "entropy_collapse").step == 12
    assert check_run(with_curve(healthy_rows(20), "entropy", [0.004] * 20)) == []  # never above the floor


def test_entropy_collapse_needs_a_sustained_fall_not_one_low_step():
    values = [0.8] * STEPS
    values[30] = 0.01
    assert check_run(with_curve(healthy_rows(), "entropy", values)) == []


def test_kl_spike_fires_at_the_spike_with_the_running_level_as_evidence():
    rows = healthy_rows()
    rows[39]["kl"] = 1.0
    alarm = only(check_run(rows), "kl_spike")
    assert alarm.step == 40 and alarm.evidence[-1] == (40, "kl", 1.0)
    assert [e[0] for e in alarm.evidence[:-1]] == list(range(30, 40))  # the previous 10 values
    assert "learning_rate" in alarm.advice


def test_kl_ramp_from_zero_and_demo_sized_noise_are_not_spikes():
    rows = healthy_rows()
    ramp = [0.0, 2e-4, 1.5e-3, 8e-3, 0.036, 0.056, 0.024, 0.014, 0.028, 0.042]  # the demo's first 10 steps
    rows = with_curve(rows, "kl", ramp + [0.03] * (STEPS - 10))
    rows[20]["kl"] = 8.4 * 0.03  # the demo's biggest one-step jump: 8.4x its running level
    assert "kl_spike" not in kinds(check_run(rows))
    rows[20]["kl"] = 10 * 0.03  # 10x fires
    assert only(check_run(rows), "kl_spike").step == 21


def test_completion_length_explosion_and_collapse():
    grow = with_curve(healthy_rows(), "completions/mean_length", [100 * 1.05**s for s in range(STEPS)])
    alarm = only(check_run(grow), "length_explosion")
    assert alarm.metric == "completions/mean_length" and "max_completion_length" in alarm.advice
    shrink = with_curve(healthy_rows(), "completions/mean_length", [100 * 0.95**s for s in range(STEPS)])
    assert only(check_run(shrink), "length_collapse").step == first_step_firing(shrink, "length_collapse")
    tiny = with_curve(healthy_rows(), "completions/mean_length", [2.0] * 10 + [7.0] * (STEPS - 10))
    assert check_run(tiny) == []  # 3.5x, but 5 tokens


def test_truncation_above_five_percent_over_three_steps():
    values = [0.0] * 20 + [0.2] * (STEPS - 20)
    alarm = only(check_run(with_curve(healthy_rows(), "completions/clipped_ratio", values)), "truncation")
    assert alarm.step == 21 and "mask_truncated_completions" in alarm.advice  # (0 + 0 + 0.2) / 3 > 5%
    at_limit = with_curve(healthy_rows(), "completions/clipped_ratio", [0.05] * STEPS)
    assert check_run(at_limit) == []  # "above 5%"
    one_off = [0.0] * STEPS
    one_off[30] = 0.1
    assert check_run(with_curve(healthy_rows(), "completions/clipped_ratio", one_off)) == []


def test_tool_failures_fire_above_half_over_three_steps_with_calls():
    calls = with_curve(healthy_rows(), "tools/call_frequency", [1.0] * STEPS)
    failures = [0.1] * 20 + [0.9] * (STEPS - 20)
    alarm = only(check_run(with_curve(calls, "tools/failure_frequency", failures)), "tool_failures")
    assert alarm.step == 22 and [e[0] for e in alarm.evidence] == [20, 21, 22]  # (0.1 + 0.9 + 0.9) / 3 > 0.5
    assert "tool_call_format" in alarm.advice and alarm.title == "Most tool calls fail"
    assert check_run(with_curve(calls, "tools/failure_frequency", [0.5] * STEPS)) == []  # "more than half"
    # steps without any call do not count: a failure frequency of 1.0 there would be 0/0 (logged as 0)
    no_calls = with_curve(healthy_rows(), "tools/call_frequency", [0.0] * STEPS)
    assert check_run(with_curve(no_calls, "tools/failure_frequency", [1.0] * STEPS)) == []


def test_no_learning_signal_needs_a_window_of_flat_groups():
    values = [0.2] * 30 + [1.0] * (STEPS - 30)
    alarm = only(check_run(with_curve(healthy_rows(), "frac_reward_zero_std", values)), "no_learning_signal")
    assert alarm.step == 35 and [e[0] for e in alarm.evidence] == [31, 32, 33, 34, 35]  # mean 1.0 over 5 rows
    assert "dynamic_sampling" in alarm.advice
    short = [0.2] * STEPS
    short[30:34] = [1.0] * 4
    assert check_run(with_curve(healthy_rows(), "frac_reward_zero_std", short)) == []
    assert check_run(with_curve(healthy_rows(), "frac_reward_zero_std", [0.8] * STEPS)) == []  # the demo's peak


def test_reward_dominance_by_weighted_spread():
    rows = with_curve(healthy_rows(), "rewards/length/std", [20.0] * STEPS)
    alarm = only(check_run(rows), "reward_dominance")
    assert alarm.metric == "rewards/length/std" and alarm.step == 3  # DOMINANCE_MIN_ROWS rows
    assert "normalize_then_sum" in alarm.advice and "'length'" in alarm.message
    assert check_run(rows, reward_weights={"length": 0.01}) == []  # weighted: 0.2 against 0.6
    saturated = with_curve(healthy_rows(), "rewards/format/std", [0.0] * STEPS)
    assert check_run(saturated) == []  # a constant function is not drowned: it has no spread


def eval_rows(values, steps=(20, 40, 60)):
    return [{"step": s, "eval/reward": v, "eval/rewards/correct/mean": v} for s, v in zip(steps, values)]


def merged(train, evals):
    """Eval rows after the train row of the same step, as the trainer logs them."""
    out = []
    for row in train:
        out.append(row)
        out += [e for e in evals if e["step"] == row["step"]]
    return out


def test_train_reward_up_while_eval_falls():
    rows = merged(healthy_rows(), eval_rows([0.6, 0.7, 0.5]))
    alarms = [a for a in check_run(rows) if a.kind == "train_up_eval_down"]
    assert {a.metric for a in alarms} == {"eval/reward", "eval/rewards/correct/mean"}
    alarm = alarms[0]
    assert alarm.step == 60
    assert (40, "eval/reward", 0.7) in alarm.evidence and (60, "eval/reward", 0.5) in alarm.evidence
    assert check_run(merged(healthy_rows(), eval_rows([0.6, 0.7, 0.75]))) == []
    assert check_run(merged(healthy_rows(), eval_rows([0.6]))) == []  # one evaluation: nothing to compare
    lower = {"eval/rewards/correct/mean"}  # as if an error rate: 0.6 -> 0.7 got worse, 0.7 -> 0.5 is no alarm
    flipped = [(a.metric, a.step) for a in check_run(rows, lower_is_better=lower) if a.kind == "train_up_eval_down"]
    assert flipped == [("eval/rewards/correct/mean", 40), ("eval/reward", 60)]
    rising_error = merged(healthy_rows(), eval_rows([0.3, 0.2, 0.4]))
    alarm = next(a for a in check_run(rising_error, lower_is_better={"eval/reward"}) if a.metric == "eval/reward")
    assert alarm.step == 60 and "rose from 0.2 (step 40, its best) to 0.4 (step 60)" in alarm.message
    falling_train = with_curve(healthy_rows(), "reward", [1.0 - s / STEPS for s in range(STEPS)])
    assert "train_up_eval_down" not in kinds(check_run(merged(falling_train, eval_rows([0.6, 0.7, 0.5]))))


def test_loss_that_is_beta_times_kl_gets_the_explanation():
    rows = healthy_rows()
    rows = [{**row, "loss": 0.04 * row["kl"]} for row in rows]
    alarm = only(check_run(rows), "loss_is_kl")
    assert alarm.severity == "info" and alarm.step == 10 and "0.04" in alarm.message and "inferred" in alarm.message
    assert "zero mean by construction" in alarm.advice and "reward" in alarm.advice
    given = only(check_run(rows, beta=0.04), "loss_is_kl")
    assert "inferred" not in given.message
    assert check_run(rows, beta=0.0) == []
    assert "loss_is_kl" not in kinds(check_run(rows, beta=0.1))  # loss = 0.04 kl is not 0.1 kl


def test_monitor_returns_each_alarm_once_at_the_row_it_appears():
    rows = with_curve(healthy_rows(), "entropy", [0.8 * 0.9**s for s in range(STEPS)])
    monitor = HealthMonitor()
    fired = [(row["step"], alarm) for row in rows for alarm in monitor.update(row)]
    assert [(s, a.kind) for s, a in fired] == [(fired[0][0], "entropy_collapse")]
    assert fired[0][1].step == fired[0][0] and monitor.alarms == [fired[0][1]]
    assert check_run(rows) == monitor.alarms


def test_several_problems_in_one_run_fire_in_order():
    rows = healthy_rows()
    rows = with_curve(rows, "entropy", [0.8 * 0.9**s for s in range(STEPS)])
    rows = with_curve(rows, "completions/clipped_ratio", [0.0] * 45 + [0.3] * 15)
    rows[39]["kl"] = 2.0
    alarms = check_run(rows)
    assert kinds(alarms) == ["entropy_collapse", "kl_spike", "truncation"]
    assert [a.step for a in alarms] == sorted(a.step for a in alarms)


def test_alarm_text_and_dict():
    rows = with_curve(healthy_rows(), "frac_reward_zero_std", [1.0] * STEPS)
    alarm = only(check_run(rows), "no_learning_signal")
    assert str(alarm).startswith("[No learning signal, step 5]") and alarm.advice in str(alarm)
    data = json.loads(json.dumps(alarm.to_dict()))
    assert data["kind"] == "no_learning_signal" and data["title"] == "No learning signal"
    assert set(ALARM_TITLES) == {
        "entropy_collapse", "kl_spike", "length_explosion", "length_collapse", "truncation", "tool_failures",
        "no_learning_signal", "reward_dominance", "train_up_eval_down", "loss_is_kl",
    }
    assert isinstance(alarm, Alarm) and alarm.key == ("no_learning_signal", "frac_reward_zero_std")


def test_an_expected_alarm_is_a_note_with_its_reason():
    rows = with_curve(healthy_rows(), "entropy", [0.8 * 0.9**s for s in range(STEPS)])
    why = "the task has one right answer"
    alarm = only(check_run(rows, expected={"entropy_collapse": why, "kl_spike": "unused"}), "entropy_collapse")
    plain = only(check_run(rows), "entropy_collapse")
    assert (alarm.severity, alarm.expected, plain.severity, plain.expected) == ("info", why, "warning", "")
    assert (alarm.step, alarm.message, alarm.evidence) == (plain.step, plain.message, plain.evidence)
    assert str(alarm).startswith(f"[Entropy collapse, step {plain.step}, expected]") and why in str(alarm)
    assert json.loads(json.dumps(alarm.to_dict()))["expected"] == why


def test_thresholds_are_documented_module_constants():
    source = open(health.__file__).read()
    for name in ("ENTROPY_COLLAPSE_FRACTION", "ENTROPY_FLOOR", "KL_SPIKE_FACTOR", "KL_SPIKE_MIN_JUMP",
                 "LENGTH_GROWTH_FACTOR", "LENGTH_SHRINK_FACTOR", "TRUNCATION_LIMIT", "TOOL_FAILURE_LIMIT", "ZERO_STD_LIMIT",
                 "DOMINANCE_SHARE", "EVAL_FALL_FRACTION", "LOSS_KL_TOLERANCE"):
        value = getattr(health, name)
        assert isinstance(value, float) and math.isfinite(value)
        assert f'{name} = ' in source and '"""' in source.split(f"{name} = ")[1].split("\n")[1], name
    assert health.TRUNCATION_LIMIT == 0.05


@pytest.mark.parametrize("n", [20_000])
def test_update_cost_does_not_grow_with_the_run(n):
    rows = merged(healthy_rows(n), eval_rows([0.5] * (n // 10), steps=range(10, n + 1, 10)))
    started = time.perf_counter()
    check_run(rows[:2000])
    small = time.perf_counter() - started
    started = time.perf_counter()
    check_run(rows)
    large = time.perf_counter() - started
    assert large < 10 * small * 3 + 1.0  # ~linear in rows (10x the rows), not quadratic (100x)
