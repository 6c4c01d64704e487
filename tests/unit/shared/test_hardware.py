"""--dtype auto and --threads 0 choose for the hardware they find (CPU flags injected)."""

import os
from pathlib import Path

import pytest

from bench.environment import machine
from shared.hardware import choose_dtype, matmul_flags, usable_cores

AVX2_EPYC = {"fpu", "sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize(
    ("device", "flags", "dtype", "because"),
    [
        ("cpu", AVX2_EPYC, "float32", "no avx512_bf16"),
        ("cpu", AVX2_EPYC | {"avx512f", "avx512_bf16"}, "bfloat16", "avx512_bf16"),
        ("cpu", SAPPHIRE_RAPIDS, "bfloat16", "avx512_bf16"),
        ("cpu", AVX2_EPYC | {"amx_bf16"}, "bfloat16", "amx_bf16"),
        ("cuda", AVX2_EPYC, "bfloat16", "CUDA"),
    ],
)
def test_auto_dtype_follows_the_hardware(device: str, flags: set[str], dtype: str, because: str) -> None:
    choice = choose_dtype("auto", device, flags)
    assert choice.name == dtype and because in choice.reason


def test_an_explicit_dtype_is_kept() -> None:
    assert choose_dtype("bfloat16", "cpu", AVX2_EPYC).name == "bfloat16"
    assert choose_dtype("float32", "cuda", set()).reason == "set by --dtype"


def test_matmul_flags_in_a_fixed_order() -> None:
    assert matmul_flags(SAPPHIRE_RAPIDS) == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"]
    assert machine()["cpu_flags"]  # the bench's machine record reads the same /proc field


def _cgroup(root: Path, cpu_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def test_usable_cores_respect_affinity_and_the_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "none") == affinity  # no cgroup files: affinity alone
    assert usable_cores(_cgroup(tmp_path / "unlimited", "max 100000")) == affinity
    assert usable_cores(_cgroup(tmp_path / "half", "50000 100000")) == 1  # half a CPU still gets a thread
    assert usable_cores(_cgroup(tmp_path / "many", "6400000 100000")) == affinity  # quota above the affinity
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path / "v1") == 1
