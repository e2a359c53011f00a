"""scripts/apply_megatron_patch.sh on synthetic git repositories, and the shipped patch's shape.

Why synthetic: CI has no Megatron-LM checkout and the project may not ship upstream code, so the
apply script's checks (not a directory, not a checkout, wrong file, patch that does not apply,
already applied) run against a repository and a patch made up here. The shipped patch against a
real checkout is tested in test_patch_megatron_lm.py when MEGATRON_LM_DIR is set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "scripts" / "apply_megatron_patch.sh"
SHIPPED_PATCH = ROOT / "patches" / "megatron-lm-core_v0.19.x-omnibal.patch"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

# A made-up training script and its made-up patched version (not upstream text).
ORIGINAL = "def main():\n    return 'plain'\n\n\nif __name__ == '__main__':\n    main()\n"
PATCHED = (
    "import sys\n\n\ndef main():\n    return 'plain'\n\n\n"
    "if __name__ == '__main__':\n    if '--omnibal' in sys.argv:\n        sys.exit(0)\n    main()\n"
)


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    out = subprocess.run(
        ["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout


def make_checkout(path: Path, content: str = ORIGINAL, tag: str | None = "core_v0.19.0") -> Path:
    """A git repository holding pretrain_vlm.py with `content`, committed (and tagged)."""
    path.mkdir()
    git(path, "init", "-q")
    (path / "pretrain_vlm.py").write_text(content)
    git(path, "add", "pretrain_vlm.py")
    git(path, "commit", "-q", "-m", "stand-in")
    if tag:
        git(path, "tag", tag)
    return path


def make_patch(tmp_path: Path) -> Path:
    """A patch ORIGINAL -> PATCHED, made by git in a throw-away repository."""
    repo = make_checkout(tmp_path / "patch-source", tag=None)
    (repo / "pretrain_vlm.py").write_text(PATCHED)
    patch = tmp_path / "omnibal.patch"
    patch.write_text("A made-up patch for the tests.\n\n" + git(repo, "diff"))
    return patch


def run_apply(target: Path | str, patch: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMNIBAL_MEGATRON_PATCH": str(patch)}
    return subprocess.run(
        ["bash", str(APPLY), str(target)], env=env, capture_output=True, text=True, timeout=60
    )


def test_applies_then_detects_already_applied(tmp_path: Path) -> None:
    patch = make_patch(tmp_path)
    checkout = make_checkout(tmp_path / "mlm")
    first = run_apply(checkout, patch)
    assert first.returncode == 0, first.stderr
    assert "Applied" in first.stdout
    assert "core_v0.19.0" in first.stdout
    assert "warning" not in first.stderr
    assert (checkout / "pretrain_vlm.py").read_text() == PATCHED

    second = run_apply(checkout, patch)
    assert second.returncode == 0, second.stderr
    assert "Already applied" in second.stdout
    assert (checkout / "pretrain_vlm.py").read_text() == PATCHED


def test_patch_that_does_not_apply_changes_nothing(tmp_path: Path) -> None:
    patch = make_patch(tmp_path)
    other = "def main():\n    return 'locally modified'\n"
    checkout = make_checkout(tmp_path / "mlm", content=other)
    result = run_apply(checkout, patch)
    assert result.returncode == 1
    assert "does not apply" in result.stderr
    assert "nothing was changed" in result.stderr
    assert (checkout / "pretrain_vlm.py").read_text() == other


def test_other_version_warns_but_applies(tmp_path: Path) -> None:
    patch = make_patch(tmp_path)
    checkout = make_checkout(tmp_path / "mlm", tag="core_v0.12.0")
    result = run_apply(checkout, patch)
    assert result.returncode == 0, result.stderr
    assert "warning: made for tag core_v0.19.x, found core_v0.12.0" in result.stderr
    assert (checkout / "pretrain_vlm.py").read_text() == PATCHED


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such directory"),
        ("plain-dir", "is not a git checkout"),
        ("subdir", "not its top"),
        ("no-script", "has no pretrain_vlm.py"),
    ],
)
def test_rejects_what_is_not_a_megatron_checkout(tmp_path: Path, case: str, message: str) -> None:
    patch = make_patch(tmp_path)
    target = tmp_path / case
    if case == "plain-dir":
        target.mkdir()
        (target / "pretrain_vlm.py").write_text(ORIGINAL)
    elif case == "subdir":
        target = make_checkout(tmp_path / "mlm") / "sub"
        target.mkdir()
    elif case == "no-script":
        target.mkdir()
        git(target, "init", "-q")
    result = run_apply(target, patch)
    assert result.returncode == 1
    assert message in result.stderr
    assert str(target) in result.stderr or case == "subdir"


def test_refuses_a_checkout_patched_by_another_version(tmp_path: Path) -> None:
    """A pretrain_vlm.py that already hands runs to megatron_omnibal some other way (an older
    patch) is left untouched, with the command that restores it."""
    patch = make_patch(tmp_path)
    older = ORIGINAL + "# from megatron_omnibal.megatron.training.pretrain_vlm import main\n"
    checkout = make_checkout(tmp_path / "mlm", content=older)
    result = run_apply(checkout, patch)
    assert result.returncode == 1
    assert "already carries another version of the megatron-omnibal patch" in result.stderr
    assert f"git -C {checkout} checkout -- pretrain_vlm.py" in result.stderr
    assert (checkout / "pretrain_vlm.py").read_text() == older


def test_missing_patch_file_and_usage(tmp_path: Path) -> None:
    checkout = make_checkout(tmp_path / "mlm")
    result = run_apply(checkout, tmp_path / "nope.patch")
    assert result.returncode == 1
    assert "patch file not found" in result.stderr
    usage = subprocess.run(["bash", str(APPLY)], capture_output=True, text=True)
    assert usage.returncode == 2
    assert "Usage: scripts/apply_megatron_patch.sh MEGATRON_LM_DIR" in usage.stderr
    assert (checkout / "pretrain_vlm.py").read_text() == ORIGINAL


def test_shipped_patch_only_adds_lines_to_pretrain_vlm(tmp_path: Path) -> None:
    """A run without --omnibal stays unchanged: the patch removes or rewrites no upstream line."""
    numstat = subprocess.run(
        ["git", "apply", "--numstat", str(SHIPPED_PATCH)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    added, deleted, path = numstat
    assert path == "pretrain_vlm.py"
    assert int(added) > 0
    assert deleted == "0"
    added_lines = [
        line[1:]
        for line in SHIPPED_PATCH.read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    text = "\n".join(added_lines)
    assert "from megatron_omnibal.megatron.training import handover" in text
    assert "sys.exit(handover.run())" in text and "handover.prepare_reimport()" in text
    assert "from megatron_omnibal.megatron.flags.args import add_omnibal_args" in text
