"""Whether the vLLM tests can run: they need the vllm extra (`bash scripts/setup.sh dev,vllm`).

Without vLLM they are skipped, except where GRPOKIT_REQUIRE_VLLM=1 (CI sets it): then a missing vLLM is an error
at collection, so an install step that silently failed cannot turn the vLLM tests into skips.
"""

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("GRPOKIT_REQUIRE_VLLM") == "1":
    raise RuntimeError("GRPOKIT_REQUIRE_VLLM=1 but vLLM is not installed: run `bash scripts/setup.sh dev,vllm`.")

requires_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (bash scripts/setup.sh dev,vllm)")
