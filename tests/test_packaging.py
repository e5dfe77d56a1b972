"""pagedserve installs under one import name: the wheel's only top-level names are `pagedserve` and its
dist-info, and it installs beside a distribution that owns top-level `kernels`, `services` and `shared`
without either touching the other's files."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import pagedserve

ROOT = Path(__file__).resolve().parent.parent
OTHER_NAMES = ("kernels", "services", "shared")


def _pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True, timeout=300)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(pagedserve's wheel, a tiny wheel of another distribution that owns kernels/, services/, shared/)."""
    out = tmp_path_factory.mktemp("wheels")
    _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT))
    other = tmp_path_factory.mktemp("other")
    (other / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "other-generic-names"\nversion = "1.0"\n'
        f"[tool.setuptools]\npackages = {list(OTHER_NAMES)!r}\n".replace("'", '"')
    )
    for name in OTHER_NAMES:
        (other / name).mkdir()
        (other / name / "__init__.py").write_text(f"OWNER = 'other-generic-names:{name}'\n")
    _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(other))
    [ours] = out.glob("pagedserve-*.whl")
    [theirs] = out.glob("other_generic_names-*.whl")
    return ours, theirs


def test_the_wheel_installs_only_the_pagedserve_name(wheels: tuple[Path, Path]) -> None:
    ours, _ = wheels
    with zipfile.ZipFile(ours) as wheel:
        top_level = {name.split("/")[0] for name in wheel.namelist()}
        names = set(wheel.namelist())
    assert top_level == {"pagedserve", f"pagedserve-{pagedserve.__version__}.dist-info"}
    for module in (
        "pagedserve/__main__.py",
        "pagedserve/services/cli.py",
        "pagedserve/kernels/paged_attention.py",
        "pagedserve/shared/protocol.py",
        "pagedserve/services/gateway/grpc_api/pagedserve_pb2.py",
    ):
        assert module in names


@pytest.mark.parametrize("order", ["pagedserve_first", "other_first"])
def test_installs_beside_a_package_that_owns_the_generic_names(
    wheels: tuple[Path, Path], tmp_path: Path, order: str
) -> None:
    ours, theirs = wheels
    env_dir = tmp_path / "venv"
    # System site-packages supply pagedserve's dependencies (torch, ...); both wheels go into the venv itself.
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for wheel in (ours, theirs) if order == "pagedserve_first" else (theirs, ours):
        # The venv runs the system's pip; --force-reinstall because this checkout is installed there too.
        _pip(python, "install", "--no-deps", "--no-compile", "--force-reinstall", str(wheel))

    help_text = subprocess.run(
        [str(env_dir / "bin" / "pagedserve"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert help_text.returncode == 0, help_text.stderr
    assert "usage:" in help_text.stdout and "serve" in help_text.stdout

    probe = "; ".join(
        [
            "import pagedserve, pagedserve.services.cli, kernels, services, shared",
            "print(pagedserve.__file__)",
            "print(kernels.OWNER, services.OWNER, shared.OWNER)",
        ]
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    location, owners = result.stdout.splitlines()
    assert location.startswith(site)
    assert owners.split() == [f"other-generic-names:{name}" for name in OTHER_NAMES]


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    assert pagedserve.__version__ == version("pagedserve")
