"""Tools for multi-turn rollouts: functions the model calls (toolbox.py), how calls are written and results read
back (formats.py; the tokenizer's own parser: schema.py; the format a chat template writes: detect.py), and the
built-in tools (builtin.py). The episode loop that uses them is grpokit.rollout.multiturn; docs/tools.md has the
whole picture."""

from grpokit.tools.builtin import calculator, python
from grpokit.tools.detect import detect_tool_call_format
from grpokit.tools.formats import TOOL_CALL_FORMATS, ToolCall, ToolResult, bind_format, resolve_format
from grpokit.tools.schema import response_parsing
from grpokit.tools.toolbox import TOOLS, ToolError, Toolbox, tool_schema

__all__ = [
    "TOOLS",
    "TOOL_CALL_FORMATS",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "Toolbox",
    "bind_format",
    "calculator",
    "detect_tool_call_format",
    "python",
    "resolve_format",
    "response_parsing",
    "tool_schema",
]
