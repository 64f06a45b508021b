"""`grpo report`: the HTML page from a hand-written run folder and from a real tiny run, through the CLI, and
rendered by a real headless browser (chromium) to check that every chart's SVG and the planted alarm show."""

import json
import math
import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from grpokit.cli import main
from grpokit.observe.report import PLOTS, ReportError, decimate, render, load_run, svg_line_chart, write_report
from procs import run_tree

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
EVIL = "<script>alert('x')</script> & \"quoted\""


def metric_row(step):
    """One logged row in the trainer's format (docs/metrics.md); entropy collapses from step 10 on."""
    return {
        "step": step, "epoch": step / STEPS, "reward": 0.2 + 0.02 * step, "reward_std": 0.3,
        "frac_reward_zero_std": 0.25, "rewards/exact/mean": 0.1 + 0.02 * step, "rewards/exact/std": 0.4,
        "rewards/fmt/mean": 0.9, "rewards/fmt/std": 0.2,
        "completions/mean_length": 40.0 + step % 3, "completions/min_length": 5.0, "completions/max_length": 64.0,
        "completions/clipped_ratio": 0.0, "tokens_per_second": 900.0, "generation_seconds": 0.5,
        "num_tokens": 512 * step,
        "loss": 0.01 * math.sin(step), "kl": 0.01 + 0.001 * (step % 4), "clip_ratio/low_mean": 0.0,
        "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "ratio_mean": 1.0,
        "entropy": 0.9 if step < 10 else 0.01, "grad_norm": 0.4, "learning_rate": 1e-5, "step_seconds": 1.2,
        "nonfinite_skipped": 0, "nonfinite_skips": 0,
        "tools/call_frequency": 0.5 + 0.01 * step, "tools/failure_frequency": 0.1, "tools/turns_mean": 1.5,
        "completions/tool_tokens_mean": 6.0,
    }


def completion_rows(step):
    rows = []
    for i in range(8):
        rows.append({"step": step, "prompt": f"{i}+{i}=" if i else EVIL,
                     "completion": f"answer {i}" if i != 3 else EVIL,
                     "rewards": {"exact": 1.0 if i % 2 else 0.0, "fmt": None if i == 5 else 0.5},
                     "advantage": (i - 3.5) / 2.3})
    rows.append({"step": step, "prompt": [{"role": "user", "content": "chat <b>prompt</b>"}], "completion": "chat",
                 "rewards": {"exact": 2.0, "fmt": 1.0}, "advantage": 1.5})
    return rows


@pytest.fixture
def run_dir(tmp_path):
    """A run folder as the trainer leaves it, with None/NaN values, an eval row and a torn last line."""
    out = tmp_path / "run"
    out.mkdir()
    rows = [metric_row(s) for s in range(1, STEPS + 1)]
    rows[4]["kl"] = None
    rows[5]["grad_norm"] = float("nan")
    rows.append({"step": STEPS, "eval/reward": 0.55, "eval/rewards/exact/mean": 0.5})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 31, "reward": 0.'  # killed mid-append
    (out / "metrics.jsonl").write_text(text)
    completions = completion_rows(1) + completion_rows(10) + completion_rows(20)
    (out / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in completions))
    return out


def grpo(*args, timeout=120):
    return run_tree([sys.executable, "-m", "grpokit.cli", *args], timeout=timeout, cwd=ROOT)


class Figures(HTMLParser):
    """Each <figure class="plot">: its attributes and whether an <svg> with a path or circle is inside it."""

    def __init__(self):
        super().__init__()
        self.figures, self.current, self.alarms = {}, None, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure" and "plot" in (attrs.get("class") or ""):
            self.current = attrs["id"]
            self.figures[self.current] = {"attrs": attrs, "svg": 0, "marks": 0}
        elif self.current and tag == "svg":
            self.figures[self.current]["svg"] += 1
        elif self.current and tag in ("path", "circle"):
            self.figures[self.current]["marks"] += 1
        elif tag == "li" and "alarm" in (attrs.get("class") or ""):
            self.alarms.append(attrs)

    def handle_endtag(self, tag):
        if tag == "figure":
            self.current = None


def parse(page):
    parser = Figures()
    parser.feed(page)
    return parser


def assert_self_contained(page):
    assert "Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\"" in page
    for fetches in ("http://", "https://", "src=", "<link", "<script", "@import", "url("):
        assert fetches not in page.replace(EVIL_ESCAPED, ""), fetches


EVIL_ESCAPED = "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;"


def test_cli_writes_the_page_with_every_plot_alarm_and_escaped_text(run_dir):
    result = grpo("report", str(run_dir), "--steps", "1,20")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == run_dir / "report.html" and path.is_file()
    page = path.read_text()
    assert_self_contained(page)
    assert EVIL not in page and EVIL_ESCAPED in page and "chat &lt;b&gt;prompt&lt;/b&gt;" in page
    parsed = parse(page)
    for plot in PLOTS:
        assert f"plot-{plot.id}" in parsed.figures
    assert all(f["attrs"]["data-state"] == "drawn" and f["svg"] == 1 and f["marks"] > 0
               for f in parsed.figures.values())  # every metric group of this run has data
    assert parsed.figures["plot-entropy"]["attrs"]["data-metric"] == "entropy"
    assert parsed.figures["plot-eval"]["attrs"]["data-state"] == "drawn"  # one point per key: dots
    assert json.loads(parsed.figures["plot-completion-length"]["attrs"]["data-series"]) == [
        "completions/mean_length", "completions/min_length", "completions/max_length"]
    assert {"plot-other-epoch", "plot-other-tokens-per-second", "plot-other-num-tokens"} <= set(parsed.figures)
    entropy = [a for a in parsed.alarms if a["data-alarm"] == "entropy_collapse"]
    # 0.01 from step 10: at step 11 the median of the last 3 values is 0.01, under 10% of the early 0.9
    assert entropy and entropy[0]["data-step"] == "11" and entropy[0]["data-severity"] == "warning"
    assert 'class="alarm-mark"' in page  # the alarm's step is marked on the entropy chart
    assert "torn last line" in page and "line 32" in page
    assert "1 None/NaN/inf value(s) are left as gaps" in page  # the None kl and the NaN grad_norm
    assert 'id="completions-step-1"' in page and 'id="completions-step-20"' in page
    assert 'id="completions-step-10"' not in page
    best = page.index('id="completions-step-1"')
    assert page.index("chat", best) < page.index("answer 1", best)  # the chat completion (total 3) ranks first


def test_expected_alarms_file_marks_alarms_as_expected(run_dir):
    (run_dir / "expected_alarms.json").write_text(json.dumps({"entropy_collapse": "a demo's <deterministic> task"}))
    page = render(load_run(run_dir))
    entropy = [a for a in parse(page).alarms if a["data-alarm"] == "entropy_collapse"]
    assert entropy[0]["data-severity"] == "info" and entropy[0]["data-expected"] == "yes"
    assert "Expected in this run: a demo&#x27;s &lt;deterministic&gt; task" in page
    assert "of which 1 expected in this run" in page
    (run_dir / "expected_alarms.json").write_text("[1, 2]")
    page = render(load_run(run_dir))
    assert "expected_alarms.json: not a JSON object of alarm kind -&gt; reason; ignored." in page
    assert [a["data-severity"] for a in parse(page).alarms if a["data-alarm"] == "entropy_collapse"] == ["warning"]


def test_defaults_output_option_and_missing_step(run_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(run_dir), "--output", str(target), "--steps", "7"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    page = target.read_text()
    assert "No completions were logged at step 7; steps with completions: 1, 10, 20." in page
    default = write_report(run_dir)
    page = default.read_text()
    for step in (1, 10, 20):  # first, middle and last logged steps
        assert f'id="completions-step-{step}"' in page


def test_missing_folder_or_metrics_is_a_clear_error(tmp_path, capsys):
    result = grpo("report", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "metrics.jsonl not found" in result.stderr and "GRPOTrainer writes it" in result.stderr
    assert main(["report", str(tmp_path / "absent")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(ReportError, match="metrics.jsonl not found"):
        write_report(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path), "--steps", "ten"])
    assert exit_info.value.code == 2 and "comma-separated step numbers" in capsys.readouterr().err


def test_empty_run_and_missing_completions(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    page = write_report(tmp_path).read_text()
    assert "metrics.jsonl has no rows yet" in page and "completions.jsonl not found" in page
    assert "log_completions=True" in page
    parsed = parse(page)
    assert {f"plot-{p.id}" for p in PLOTS if not p.optional} == set(parsed.figures)
    assert all(f["attrs"]["data-state"] == "not-logged" and f["svg"] == 0 for f in parsed.figures.values())
    assert "No alarms" in page


def test_metrics_absent_from_a_run_are_marked_not_logged(tmp_path):
    rows = [{"step": s, "reward": 0.1 * s, "loss": 0.0} for s in range(1, 4)] + [{"step": 4, "kl": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "garbage\n"
                                            + json.dumps({"step": 5, "reward": 1.0}) + "\n")
    page = write_report(tmp_path).read_text()
    figures = parse(page).figures
    assert figures["plot-reward"]["attrs"]["data-state"] == "drawn"
    assert figures["plot-entropy"]["attrs"]["data-state"] == "not-logged" and "not logged in this run" in page
    assert figures["plot-kl"]["attrs"]["data-state"] == "not-logged" and "only None/NaN values" in page
    assert "plot-tool-calls" not in figures and "plot-tool-turns" not in figures  # optional: no tools, no panel
    assert "metrics.jsonl line 5: not valid JSON; skipped." in page


def test_svg_chart_gaps_constant_and_single_points():
    svg = svg_line_chart({"a": [(1, 1.0), (2, None), (3, 2.0), (4, 2.5)]}, metric="a")
    path = re.search(r' d="([^"]*)"', svg).group(1)
    assert path.count("M") == 2 and path.count("L") == 1  # the gap splits the line
    assert 'data-metric="a"' in svg and svg.count("<circle") == 3
    flat = svg_line_chart({"c": [(1, 0.0), (2, 0.0)]})
    assert "nan" not in flat.lower() and "inf" not in flat.lower()
    single = svg_line_chart({"s": [(5, 3.0)]}, lines=[(0.05, "limit")], marks=[(5, "alarm")])
    assert single.count("<circle") == 1 and 'class="guide"' in single and 'class="alarm-mark"' in single


def test_long_series_are_decimated_but_keep_spikes():
    points = [(float(s), 1.0) for s in range(100_000)]
    points[77_777] = (77_777.0, 50.0)
    points[5] = (5.0, None)
    kept = decimate(points)
    assert len(kept) <= 2100 and (77_777.0, 50.0) in kept and (5.0, None) in kept
    assert [x for x, _ in kept] == sorted(x for x, _ in kept)


def test_real_tiny_run_report(tmp_path, tiny_model_dir, prompt_dataset):
    from grpokit.config import GRPOConfig
    from grpokit.trainer import GRPOTrainer
    from helpers import frac_a, short

    out = tmp_path / "out"
    args = GRPOConfig(output_dir=str(out), max_steps=3, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=8, learning_rate=1e-2, disable_tqdm=True, seed=0, beta=0.04,
                      completions_logging_steps=2, eval_strategy="steps", eval_steps=1)
    evaluation = prompt_dataset.select(range(2))
    GRPOTrainer(tiny_model_dir, [frac_a, short], args, prompt_dataset, eval_dataset=evaluation).train()
    run = load_run(out)
    assert run.notes == [] and run.completions
    page = render(run)
    figures = parse(page).figures
    for plot in ("reward", "rewards-per-function", "eval", "kl", "entropy", "completion-length", "truncation",
                 "clip", "zero-std", "advantage-spread", "loss", "learning-rate", "grad-norm", "step-time"):
        assert figures[f"plot-{plot}"]["attrs"]["data-state"] == "drawn", plot
    series = {k for f in figures.values() for k in json.loads(f["attrs"]["data-series"])}
    logged = {k for row in run.metrics for k in row} - {"step"}
    assert logged <= series  # every logged metric is on some chart
    assert 'id="completions-step-1"' in page and 'id="completions-step-2"' in page
    eval_steps = [r["step"] for r in run.metrics if "eval/reward" in r]
    assert len(eval_steps) >= 3  # an evaluation per step: the eval chart is a curve
    assert_self_contained(page)


# ---------------------------------------------------------------------------------------------- browser
def chromium():
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        reason = "chromium is not installed (apt-get install chromium); the browser test needs it"
        if os.environ.get("GRPOKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + ", and GRPOKIT_REQUIRE_BROWSER=1")
        pytest.skip(reason + "; GRPOKIT_REQUIRE_BROWSER=1 makes this a failure")
    return found


def browser(binary, profile, *args, timeout=120):
    """Headless chromium in its own session, killed as a whole on timeout; no profile outside tmp."""
    flags = ["--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}"]
    return run_tree([binary, *flags, *args], timeout=timeout)


def test_chromium_renders_every_chart_and_the_alarm(run_dir, tmp_path):
    binary = chromium()
    path = write_report(run_dir)
    page = parse(path.read_text())
    result = browser(binary, tmp_path / "profile", "--dump-dom", path.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    dom = parse(result.stdout)
    assert set(dom.figures) == set(page.figures) and len(dom.figures) >= len(PLOTS)
    for figure_id, figure in page.figures.items():
        rendered = dom.figures[figure_id]
        if figure["attrs"]["data-state"] == "drawn":
            assert rendered["svg"] == 1 and rendered["marks"] > 0, figure_id
    assert any(a["data-alarm"] == "entropy_collapse" for a in dom.alarms)
    assert "Entropy collapse" in result.stdout and EVIL not in result.stdout

    shot = tmp_path / "page.png"
    result = browser(binary, tmp_path / "profile", "--hide-scrollbars", "--window-size=1280,2000",
                     f"--screenshot={shot}", path.as_uri())
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1280, 2000)
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text and curves, not a blank page
