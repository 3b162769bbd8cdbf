"""The group index's code digest (backends/x86/index.py) covers every source file and
template of the installed packages, the same files in an editable and a regular install,
and fails loudly when one is missing or unreadable (a stale binary is never handed out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from middleware.backends.x86 import index

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "_codegen_digest", None)


def test_packages_are_the_distributions() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert sorted(index.PACKAGES) == sorted(project["tool"]["setuptools"]["packages"])


def test_digest_covers_every_source_and_template() -> None:
    files = index.codegen_files()
    for name in (
        "middleware.passes/schedule_ir.py",
        "middleware/ops.py",
        "middleware/graph.py",
        "middleware/loops.py",
        "middleware/isl_helpers.py",
        "middleware/index_expr.py",
        "middleware.backends.x86/templates/group.ispc.j2",
        "middleware.backends.x86/templates/group_glue.c.j2",
        "middleware.backends.cuda/templates/kernel.cu.j2",
    ):
        assert name in files, name
    # every module of the source tree, whatever folder the editable install maps it from
    tree = {"middleware": "middleware", "middleware/frontends": "middleware.frontends"}
    tree.update({"middleware/passes": "middleware.passes"})
    tree.update({"middleware/runtime": "middleware.runtime"})
    tree.update({"middleware/backends": "middleware.backends"})
    for sub in ("x86", "cpu", "vendor", "cuda", "reference"):
        tree[f"middleware/backends/{sub}"] = f"middleware.backends.{sub}"
    for folder, pkg in tree.items():
        modules = list((REPO / folder).glob("*.py"))
        assert modules, folder
        for py in modules:
            assert f"{pkg}/{py.name}" in files, py


def test_digest_changes_with_any_file(fresh_digest: None, monkeypatch: pytest.MonkeyPatch) -> None:
    before = index.codegen_digest()
    files = index.codegen_files()
    original = files["middleware.passes/schedule_ir.py"].read_bytes()

    class Edited:
        name = "schedule_ir.py"

        def read_bytes(self) -> bytes:
            return original + b"\n# edited\n"

    files["middleware.passes/schedule_ir.py"] = Edited()
    monkeypatch.setattr(index, "codegen_files", lambda: files)
    monkeypatch.setattr(index, "_codegen_digest", None)
    assert index.codegen_digest() != before


def test_missing_package_fails_loudly(fresh_digest: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "PACKAGES", tuple(p for p in index.PACKAGES if "passes" not in p))
    with pytest.raises(index.CodegenDigestError, match="schedule_ir.py"):
        index.codegen_digest()


def test_unreadable_file_fails_loudly(fresh_digest: None, monkeypatch: pytest.MonkeyPatch) -> None:
    class Unreadable:
        name = "ops.py"

        def read_bytes(self) -> bytes:
            raise PermissionError("denied")

    files = dict(index.codegen_files(), **{"middleware/ops.py": Unreadable()})
    monkeypatch.setattr(index, "codegen_files", lambda: files)
    with pytest.raises(index.CodegenDigestError, match="ops.py"):
        index.codegen_digest()


LIST_FILES = """
import json, sys
from middleware.backends.x86 import index
print(json.dumps([index.__file__, sorted(index.codegen_files()), index.codegen_digest()]))
"""


def test_regular_install_digests_the_same_files(tmp_path: Path) -> None:
    """A non-editable install (``pip install --target``) lists the same files by name, and
    (same contents) gives the same digest as the source tree."""
    src = tmp_path / "src"
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for rel in filter(None, (r.decode() for r in tracked)):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    # untracked files of the working tree are hashed by the editable install too
    for folder in ("middleware", "frontends", "passes", "runtime", "backends"):
        for f in (REPO / folder).rglob("*"):
            rel = f.relative_to(REPO)
            if f.is_file() and "__pycache__" not in rel.parts and not (src / rel).exists():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                (src / rel).write_bytes(f.read_bytes())
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(target), str(src)],
        check=True,
        capture_output=True,
    )
    env = dict(os.environ, PYTHONPATH=str(target))

    def listing(cwd: Path, environ: dict[str, str]) -> list:
        out = subprocess.run(
            [sys.executable, "-c", LIST_FILES],
            cwd=cwd,
            env=environ,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])

    installed_at, installed, installed_digest = listing(tmp_path, env)
    assert Path(installed_at).is_relative_to(target), installed_at
    editable_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _, editable, editable_digest = listing(tmp_path, editable_env)
    assert installed == editable
    assert installed_digest == editable_digest
