"""What gets installed: the wheel `pip wheel .` builds holds every package and file of node/,
protocol/, training/ and kernels/, the `swarmtrain` console script, and nothing else of the
checkout; deploy/Dockerfile's image installs it and its entrypoint answers with our version.

Both build from a copy of the checkout's files (tracked, and untracked ones git does not
ignore), so no build writes build/ or *.egg-info into the checkout and the image's build
context holds no .venv. The image test runs only where a Docker engine answers (minutes:
it downloads torch) and skips elsewhere, saying so.
"""

import configparser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
LAYERS = ("node", "protocol", "training", "kernels")
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
DIST_INFO = f"swarmtrain-{VERSION}.dist-info"
IMAGE = "swarmtrain-test"


def source_files() -> list[str]:
    """The checkout's files a commit would see: tracked (still present) and untracked, not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (ROOT / name).is_file()})


def copy_sources(names: list[str], into: Path) -> Path:
    for name in names:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, into / name)
    return into


@pytest.fixture(scope="module")
def sources() -> list[str]:
    return source_files()


@pytest.fixture(scope="module")
def wheel(sources: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = copy_sources(sources, tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)]
    subprocess.run([*pip, *build], check=True, capture_output=True)
    (built,) = (tmp / "dist").glob("*.whl")
    assert built.name == f"swarmtrain-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(built) as archive:
        yield archive


def layer_files(sources: list[str]) -> list[str]:
    return [name for name in sources if name.split("/", 1)[0] in LAYERS]


def test_every_package_of_the_four_layers_is_in_the_wheel(sources: list[str], wheel: zipfile.ZipFile) -> None:
    packages = [name for name in layer_files(sources) if name.endswith("/__init__.py")]
    assert "node/algorithms/spes/__init__.py" in packages
    assert {f"{layer}/__init__.py" for layer in LAYERS} <= set(packages)
    missing = sorted(set(packages) - set(wheel.namelist()))
    assert missing == [], f"packages missing from the wheel: {missing}"


def test_every_file_of_the_four_layers_is_in_the_wheel(sources: list[str], wheel: zipfile.ZipFile) -> None:
    files = layer_files(sources)  # .py files and any data file beside them
    assert len([name for name in files if name.endswith(".py")]) > 100
    missing = sorted(set(files) - set(wheel.namelist()))
    assert missing == [], f"files missing from the wheel: {missing}"


def test_the_wheel_holds_nothing_else_of_the_checkout(wheel: zipfile.ZipFile) -> None:
    top_level = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert top_level == {*LAYERS, DIST_INFO}


def test_the_wheel_installs_the_swarmtrain_console_script(wheel: zipfile.ZipFile) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{DIST_INFO}/entry_points.txt").decode())
    assert dict(entry_points["console_scripts"]) == {"swarmtrain": "node.cli:entry_point"}


def why_no_docker_engine() -> str | None:
    """None where `docker info` succeeds; else why the image test cannot run here."""
    if shutil.which("docker") is None:
        return "no docker client on PATH, so the image cannot be built here"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 60 s: no Docker engine to build the image with"
    if info.returncode != 0:
        said = (info.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return f"no Docker engine answers (`docker info` failed: {said}), so the image cannot be built here"
    return None


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_the_cpu_image_builds_and_runs_swarmtrain(sources: list[str], tmp_path: Path) -> None:
    reason = why_no_docker_engine()
    if reason is not None:
        pytest.skip(reason)
    context = copy_sources(sources, tmp_path / "context")
    built = subprocess.run(
        ["docker", "build", "-f", str(context / "deploy" / "Dockerfile"), "-t", IMAGE, str(context)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    shown = subprocess.run(["docker", "run", "--rm", IMAGE, "--version"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-4000:]
    assert shown.stdout.strip() == f"swarmtrain {VERSION}"
