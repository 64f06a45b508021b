"""Training tasks from other libraries, as grpokit datasets with their own rewards.

- grpokit.tasks.reasoning_gym: reasoning-gym's procedural tasks (pip install grpokit[tasks]); see docs/tasks.md.

Nothing here imports the task libraries until a dataset or reward is built, so `import grpokit` never needs them.
"""
