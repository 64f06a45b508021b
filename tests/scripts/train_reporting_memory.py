"""train_tiny.py, then this process's memory figures on one line: `MEMORY {"rank": R, "vm_peak": bytes, "rss_peak":
bytes, "data_end": bytes}` (/proc/self/status VmPeak, VmHWM, VmData at exit). Arguments as train_tiny.py's."""

import json
import os
import runpy
import sys
from pathlib import Path


def figures() -> dict:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = lambda name: int(fields[name].split()[0]) * 1024  # noqa: E731
    return {"rank": int(os.environ.get("RANK", "0")), "vm_peak": kib("VmPeak"), "rss_peak": kib("VmHWM"),
            "data_end": kib("VmData")}


if __name__ == "__main__":
    script = Path(__file__).resolve().parent / "train_tiny.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    # One write(2) of the whole line: the two ranks share the launcher's stdout pipe, and print's separate writes
    # of the text and its newline interleaved there (CI, 2026-11-26). A pipe write under PIPE_BUF is atomic.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("MEMORY " + json.dumps(figures()) + "\n").encode())
