"""The installed distribution is the product: its wheel holds the packages edge, cloud and shared
and no generic top-level name (bench, tools, tests run from a checkout), and the edge's entry
module imports from the wheel alone, in a process that cannot import the repository's tools."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = {"edge", "cloud", "shared"}

# Run with -S (no site: no editable install's path hooks); the wheel's folder and the
# environment's site-packages are the path, and the repository's other packages cannot be found.
IMPORT_FROM_WHEEL = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"tools", "bench", "tests"}:
            raise ImportError(f"{name} is not part of the distribution")
        return None
sys.meta_path.insert(0, Refuse())
sys.path[:0] = sys.argv[1:]
import edge.__main__, cloud.__main__, shared.models.store
print(edge.__main__.__file__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the tracked tree (a build in the checkout would leave
    build/ behind, and a stale build/ could carry old packages into the wheel)."""
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", str(source), "-w", str(out)]
    subprocess.run(pip, check=True, capture_output=True, timeout=600)
    (built,) = out.glob("specedge-*.whl")
    return built


def test_wheel_holds_only_the_product_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == PRODUCT
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "specedge-models = shared.models.store:main" in scripts
    assert "tools." not in scripts and "bench." not in scripts


def test_edge_entry_module_imports_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    done = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_FROM_WHEEL, str(unpacked), *sorted(dependencies)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(unpacked)
