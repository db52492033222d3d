"""`pip install -e .` works as in any Python project: pyproject.toml builds a wheel that holds the whole package
(its data files too) and names the dependencies the requirements files install, Triton only where it has wheels."""
import os
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirement_names(path):
    """The package names a requirements file lists (its -r includes and comments left out)."""
    names = []
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line and not line.startswith("-r"):
                names.append(re.split(r"[<>=!;\[ ]", line)[0].lower())
    return names


def test_the_wheel_holds_the_package_and_names_its_dependencies(tmp_path):
    source = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to pyproject.toml
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source)
    shutil.copytree(os.path.join(ROOT, "minibert"), source / "minibert",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # no build isolation: the setuptools beside pip builds it, with no download
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (wheel,) = os.listdir(tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:
        files = set(z.namelist())
        metadata = z.read(next(n for n in files if n.endswith(".dist-info/METADATA"))).decode()
    package = {os.path.relpath(os.path.join(folder, name), ROOT)
               for folder, subfolders, names in os.walk(os.path.join(ROOT, "minibert"))
               for name in names if name.endswith((".py", ".txt")) and "__pycache__" not in folder}
    assert package <= files, sorted(package - files)
    assert "minibert/vocab/bert-base-uncased-vocab.txt" in files and "minibert/kernels/flash_attention.py" in files
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    plain = {re.split(r"[<>=!;\[ ]", r)[0].lower() for r in requires if "extra ==" not in r}
    test_extra = {re.split(r"[<>=!;\[ ]", r)[0].lower() for r in requires if "extra == \"test\"" in r}
    assert plain == set(requirement_names("requirements.txt")), (plain, requires)
    assert set(requirement_names("tests/requirements.txt") + requirement_names("notebooks/requirements.txt")) \
        <= test_extra, requires
    assert "torch>=2.11" in requires  # the GPU image's torch; requirements.txt pins the CPU build
    assert any(r.startswith("triton>=3.6") and "sys_platform == \"linux\"" in r for r in requires), requires
    python = re.search(r"^Requires-Python: >=(\d+)\.(\d+)", metadata, re.M)
    assert python and sys.version_info[:2] >= (int(python[1]), int(python[2]))
