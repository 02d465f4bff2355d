"""A non-editable install works: the wheel built from this tree carries exactly the package (every kernel source
included, no tests or benchmarks), and a fresh venv holding only that wheel runs a CPU dispatch and combine and
finds in its installed copy the tree's kernel build inputs (equal cache keys), from a folder outside the repo.

To stay fast, the fresh venv has no pip and no torch of its own: the wheel goes in with this interpreter's pip
(`--target`, `--no-deps`), and one `.pth` line appends the folder this interpreter's torch lives in. Python does not
read the `.pth` files of a folder that a `.pth` line added, so this venv's editable install of moe_comm (a `.pth`
finder) stays off there; the scripts check that moe_comm and its kernel sources do come from the fresh venv.
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from moe_comm.backends import cuda_kernels

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders of the repo that must never ship in the wheel.
NOT_SHIPPED = ("tests", "benchmarks", "scripts", "recipes")
SUBPROCESS_TIMEOUT_S = 300

# Run first in every script: moe_comm and its kernel sources resolve inside the fresh venv (sys.prefix).
WHERE_CHECK = r"""
import sys
from pathlib import Path

import moe_comm
from moe_comm import jit

venv = Path(sys.prefix).resolve()
for what, path in (("moe_comm", moe_comm.__file__), ("moe_comm.jit.CSRC_DIR", jit.CSRC_DIR)):
    if not Path(path).resolve().is_relative_to(venv):
        raise AssertionError(f"{what} is {path}, outside the fresh venv {venv}")
"""

# One rank over gloo: every token goes to this rank in order, and combine of the received rows gives x back.
DISPATCH_COMBINE = WHERE_CHECK + r"""
import os

import torch
import torch.distributed as dist

store = dist.FileStore(os.path.join(os.getcwd(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
num_tokens, hidden, num_topk, num_experts = 32, 256, 4, 8
gen = torch.Generator().manual_seed(0)
x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
topk_idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)])
topk_idx[:, 1:][torch.rand(num_tokens, num_topk - 1, generator=gen) < 0.3] = -1  # slot 0 stays valid: all are sent
topk_weights = torch.rand(num_tokens, num_topk, generator=gen)

buf = moe_comm.Buffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk, backend="auto")
assert buf.backend == "torch", buf.backend
recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buf.dispatch(x, topk_idx, topk_weights,
                                                                   num_experts=num_experts)
assert torch.equal(recv_x, x)
assert torch.equal(recv_topk_idx, topk_idx)
assert torch.equal(recv_topk_weights, topk_weights.masked_fill(topk_idx < 0, 0))
combined, _, _ = buf.combine(recv_x, handle)
assert torch.equal(combined, x)
buf.destroy()
dist.destroy_process_group()
print("dispatch and combine ok")
"""

# The files the kernel library's and the host extension's builds read (each must resolve inside the installed csrc/)
# and the two cache keys, as JSON on the last line.
BUILD_INPUTS = WHERE_CHECK + r"""
import json

from moe_comm.backends import cuda_kernels

for path in (*cuda_kernels.kernel_sources(), *cuda_kernels.extension_sources(), cuda_kernels.INCLUDE_DIR):
    assert path.resolve().is_relative_to(venv), path
print(json.dumps(cuda_kernels.build_inputs()))
"""


def run(command: list, cwd: Path) -> str:
    """Run a command to completion; its output, or a failure that shows it."""
    out = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    if out.returncode != 0:
        pytest.fail(f"exit {out.returncode}: {' '.join(map(str, command))}\n--- stdout ---\n{out.stdout}\n"
                    f"--- stderr ---\n{out.stderr}")
    return out.stdout + out.stderr


def source_files() -> list[str]:
    """The tree as a fresh clone plus the uncommitted work would have it: tracked and untracked files, less the
    ignored ones (build/, *.egg-info, .venv, caches), as repo-relative POSIX paths."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], ROOT)
    return sorted(name for name in listed.split("\0") if name and (ROOT / name).is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, list[str]]:
    """The wheel built from a copy of this tree (so no build/ or egg-info lands in the repo and no stale build/
    of an earlier run leaks in), and the copied file list."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = source_files()
    for name in files:
        (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp / "src" / name)
    output = run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
                  "--disable-pip-version-check", "-w", tmp / "dist", tmp / "src"], tmp)
    # A deprecation carries a removal date after which the build fails: fix it before that day comes
    deprecations = [line.strip() for line in output.splitlines() if "DeprecationWarning" in line]
    assert not deprecations, "\n".join(deprecations)
    (path,) = (tmp / "dist").glob("moe_comm-*.whl")
    return path, files


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """The python of a fresh venv holding the wheel, with this interpreter's torch importable."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", venv], venv)
    python = venv / "bin" / "python"
    site_packages = Path(run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             venv).strip())
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check",
         "--target", site_packages, wheel[0]], venv)
    # Appended after the venv's own site-packages, so the installed moe_comm is found first
    (site_packages / "borrowed_torch.pth").write_text(f"{Path(torch.__file__).resolve().parents[1]}\n")
    return python


def run_script(python: Path, script: str, cwd: Path) -> str:
    """`python -I`: no PYTHONPATH, no user site, no cwd on sys.path; run from a folder outside the repo."""
    return run([python, "-I", "-c", script], cwd)


def test_wheel_ships_the_package_and_every_kernel_source(wheel):
    path, files = wheel
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = email.parser.Parser().parsestr(zf.read(metadata).decode()).get_all("Requires-Dist")
    shipped = {n for n in names if n.startswith("moe_comm/")}
    package = {n for n in files if n.startswith("moe_comm/")}
    kernels = {n for n in package if n.startswith("moe_comm/csrc/")}
    assert kernels and not kernels - shipped, f"package-data globs miss {sorted(kernels - shipped)}"
    assert shipped == package, f"missing {sorted(package - shipped)}, not in the tree {sorted(shipped - package)}"
    assert not [n for n in names if n.split("/")[0] in NOT_SHIPPED]
    # Only torch and ninja (the host extension's build) at run time: everything else is an extra
    runtime = [r for r in requires if "extra ==" not in r]
    assert [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in runtime] == ["torch", "ninja"], runtime


def test_installed_copy_dispatches_and_combines_on_cpu(venv_python, tmp_path):
    assert "dispatch and combine ok" in run_script(venv_python, DISPATCH_COMBINE, tmp_path)


def test_installed_copy_builds_what_the_tree_builds(venv_python, tmp_path, nvcc):
    """The installed copy's kernel library and host extension have the tree's cache keys, which hash every byte the
    compilers read from the package (sources and the headers they reach, found from the installed copy), the flags
    and nvcc's and torch's versions: the installed copy gives the compilers the inputs of the builds that
    test_kernels_compile compiles and loads from the tree (compiling both again here took ~45 s of CI; what the build
    needs beyond the package, nvcc and ninja, is that test's). A file left out of the wheel or changed in it changes a
    key, and `files` names it."""
    installed = json.loads(run_script(venv_python, BUILD_INPUTS, tmp_path).splitlines()[-1])
    tree = cuda_kernels.build_inputs()
    assert installed["files"] == tree["files"]
    assert installed["keys"] == tree["keys"]
