"""The GPU bundle (`scripts/gpu-bundle`, `.whl/`) is complete: pip's own resolver, offline (``--no-index``), for the
GPU machine's Python 3.12, installs rlx's GPU-check requirements from the image's packages plus the bundle alone,
with no version conflict, every bundle wheel needed, and none of the image's packages carried again.

The image's packages are stand-in wheels at the versions its list records. Where it records none, the stand-in
is at the highest floor that rlx or a bundle wheel puts on it (printed: an assumption about the machine, which
`scripts/gpu-check` checks there against the real versions before anything else)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
_spec = spec_from_loader("gpu_bundle", SourceFileLoader("gpu_bundle", str(ROOT / "scripts" / "gpu-bundle")))
bundle = module_from_spec(_spec)
_spec.loader.exec_module(bundle)

pytestmark = pytest.mark.skipif(
    not bundle.IMAGE.exists() or not list(bundle.BUNDLE.glob("*.whl")),
    reason="no GPU bundle here: make it with `.venv/bin/python scripts/gpu-bundle` (.ci/run does), and the image's "
           f"package list must be at {bundle.IMAGE}")


def stand_in(folder: Path, name: str, version: str) -> None:
    """A wheel that only says `name` `version` is installed (the image's own requirements are its business)."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: rlx\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def floor(specs: list[SpecifierSet]) -> str:
    """The lowest version every one of `specs` names as a floor (>=, ==, ~=), checked to satisfy them all."""
    floors = [Version(s.version) for spec in specs for s in spec if s.operator in (">=", "==", "~=")]
    version = str(max(floors, default=Version("0")))
    bad = [str(s) for s in specs if not s.contains(version, prereleases=True)]
    assert not bad, f"no single version is known to satisfy {bad}: record the image's version"
    return version


def requirements_on_image(image: dict[str, str | None]) -> dict[str, list[SpecifierSet]]:
    wanted: dict[str, list[SpecifierSet]] = {}
    reqs = bundle.declared() + [r for w in bundle.BUNDLE.glob("*.whl") for r in bundle.wheel_requirements(w)]
    for r in reqs:
        name = bundle.canonicalize_name(r.name)
        if name in image:
            wanted.setdefault(name, []).append(r.specifier)
    return wanted


def test_the_bundle_resolves_offline_against_the_image(tmp_path):
    image = bundle.image_packages()
    wanted = requirements_on_image(image)
    assumed = {n: floor(wanted.get(n, [])) for n, v in image.items() if v is None}
    for name, version in image.items():
        stand_in(tmp_path, name, version or assumed[name])
    print("image versions assumed (not in its list):",
          ", ".join(f"{n}>={assumed[n]}" for n in sorted(wanted) if image[n] is None))
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # no index, constraint or wheel folder of this machine
    env.pop("PIP_CONSTRAINT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--ignore-installed", "--quiet",
         "--report", str(report), "--find-links", str(bundle.BUNDLE), "--find-links", str(tmp_path),
         *bundle.PLATFORM, *(bundle.bare(r) for r in bundle.declared())],
        capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"the bundle does not resolve against the GPU image:\n{proc.stderr[-3000:]}"
    chosen = {bundle.canonicalize_name(i["metadata"]["name"]): i["download_info"]["url"]
              for i in json.loads(report.read_text())["install"]}
    carried = {bundle.wheel_name(w): w for w in bundle.BUNDLE.glob("*.whl")}
    from_bundle = {n for n, url in chosen.items() if url.startswith(bundle.BUNDLE.as_uri())}
    assert from_bundle == set(carried), (f"bundle wheels nothing needs: {sorted(set(carried) - from_bundle)}; "
                                         f"needed from the bundle but absent: {sorted(from_bundle - set(carried))}")
    again = sorted(set(carried) & set(image))
    assert not again, f"the bundle carries packages the image has: {again}"
    for name in chosen.keys() - from_bundle:
        assert name in image, f"{name} came from neither the image nor the bundle"
    assert {"pydantic", "megatron-core", "flash-linear-attention"} <= from_bundle


def test_the_bundle_travels_with_the_tree_under_the_limit():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    wheels = sum(w.stat().st_size for w in bundle.BUNDLE.glob("*.whl"))
    assert wheels < bundle.LIMIT_MIB * 2**20, f"bundle {wheels / 2**20:.1f} MiB"
    assert tree + wheels < 64 * 2**20, f"tree {tree / 2**20:.1f} MiB + bundle {wheels / 2**20:.1f} MiB"
