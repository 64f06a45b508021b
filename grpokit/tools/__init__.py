"""Tools for multi-turn rollouts: functions the model calls (toolbox.py), how calls are written and results read
back (formats.py), and the built-in tools (builtin.py). The episode loop that uses them is
grpokit.rollout.multiturn; docs/tools.md has the whole picture."""

from grpokit.tools.builtin import calculator, python
from grpokit.tools.formats import TOOL_CALL_FORMATS, ToolCall, ToolResult, resolve_format
from grpokit.tools.toolbox import TOOLS, ToolError, Toolbox, tool_schema

__all__ = [
    "TOOLS",
    "TOOL_CALL_FORMATS",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "Toolbox",
    "calculator",
    "python",
    "resolve_format",
    "tool_schema",
]
