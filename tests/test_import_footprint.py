"""What ``import middleware`` and a CPU ``optimize()`` load: not networkx (10 MiB of a
process's resident memory, which the small networks' peak-memory ratios against eager
PyTorch paid for). The CUDA backend still uses it, loaded only on a GPU run."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_cpu_run_does_not_import_networkx(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        import torch.nn as nn
        import middleware

        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).eval()
        x = torch.randn(2, 3, 8, 8)
        opt = middleware.optimize(model, example_inputs=(x,), cache_dir={str(tmp_path)!r})
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "networkx")[:3])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
