"""``python -m middleware``: help, the ``run`` command on a user's file, model-spec errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from middleware.__main__ import main
from middleware.models import ModelSpecError, load_model

USER_FILE = textwrap.dedent(
    """
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 3, padding=1)
            self.bn = nn.BatchNorm2d(5)

        def forward(self, x):
            return self.bn(self.conv(x)).relu().mean((2, 3))

    def small():
        return Net(), (3, 9, 7)

    instance = Net()
    not_a_model = 3
    """
)


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE)
    return path


def test_help_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "middleware", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: middleware" in out.stdout and "run" in out.stdout
    run_help = subprocess.run(
        [sys.executable, "-m", "middleware", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in ("--batch", "--device", "--compile", "--repeat", "torchvision:NAME"):
        assert flag in run_help.stdout


def test_no_command_prints_help(capsys) -> None:
    assert main([]) == 2
    assert "usage: middleware" in capsys.readouterr().out


@pytest.mark.parametrize("attr", ["Net", "small", "instance"])
def test_run_on_a_user_file(user_file, attr, capsys) -> None:
    code = main(["run", f"{user_file}:{attr}", "--batch", "3", "--repeat", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"user_model.py:{attr}: batch 3" in out
    assert "outputs match PyTorch: yes" in out
    table = out.split("\n\n")[-1].splitlines()
    assert table[0].split() == ["latency", "ms", "speedup", "peak", "MiB", "memory"]
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert set(rows) == {"eager", "middleware"}
    assert rows["eager"][2] == "1.00x" and float(rows["middleware"][1]) > 0
    assert ("input 3x9x7" in out) == (attr == "small")


def test_load_model_torchvision() -> None:
    loaded = load_model("torchvision:inception_v3")
    assert loaded.input_shape == (3, 299, 299) and not loaded.model.training
    assert loaded.model.aux_logits is False
    x = loaded.example(2)
    assert x.shape == (2, 3, 299, 299) and torch.equal(x, loaded.example(2))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet18", "use torchvision:NAME"),
        ("torchvision:resnet_nope", "torchvision has no model 'resnet_nope'; choose one of"),
        ("no/such/file.py:Net", "no such file"),
        ("{file}:Missing", "has no 'Missing'; it defines: Net, small, instance"),
        ("{file}:not_a_model", "is a int, not a module or a function"),
    ],
)
def test_bad_model_specs(user_file, spec, message, capsys) -> None:
    spec = spec.format(file=user_file)
    with pytest.raises(ModelSpecError, match=message.replace("(", r"\(")):
        load_model(spec)
    assert main(["run", spec]) == 2
    assert message in capsys.readouterr().err


def test_bad_device_is_reported_without_traceback(capsys) -> None:
    assert main(["run", "torchvision:resnet18", "--device", "tpu"]) == 2
    assert "error: unknown device 'tpu'" in capsys.readouterr().err
