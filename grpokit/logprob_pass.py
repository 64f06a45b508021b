"""Moved to grpokit/passes/ (the log-prob passes as a package); this name stays for code that imports it."""

from grpokit.passes import (PACK_WHEN, completion_logprobs, distinct_rows, module_logprobs, output_head, packs,
                            padded_positions, varlen)

__all__ = ["PACK_WHEN", "completion_logprobs", "distinct_rows", "module_logprobs", "output_head", "packs",
           "padded_positions", "varlen"]
