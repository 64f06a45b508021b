"""The observation and report side of a run: what is written while it trains (`metrics`: metrics.jsonl,
completions.jsonl, the progress display; `trackers`: tensorboard / wandb / trackio / a user's tracker), the
run-health alarms over the logged rows (`health`), and `grpo report`'s page made from those files (`report`)."""
