"""PTX of every kernel source, to show what a change does to the device code without a GPU (issue 12: "kernel PTX
compared before and after"): nvcc -ptx for sm_90a with the library's build flags and the generated abi.h, one .ptx
per source in OUT; with `--against DIR` (an earlier OUT, e.g. from the commit before), the instructions that differ
per source, `.loc` lines and comments left out (line numbers move with every edit).

    git stash; python scripts/ptx_compare.py --out /tmp/ptx_before; git stash pop
    python scripts/ptx_compare.py --out /tmp/ptx_after --against /tmp/ptx_before [--flags -DMOE_COMM_BLOCK_TIMES]
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_comm.backends import cuda_kernels
from moe_comm.jit import compiler


def write_ptx(out: Path, flags: list[str]) -> list[Path]:
    """One .ptx per kernel source in `out`, built as the library is (DEFAULT_FLAGS less -shared/-lineinfo)."""
    out.mkdir(parents=True, exist_ok=True)
    build_flags = [f for f in compiler.DEFAULT_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC", "-lineinfo")]
    written = []
    with tempfile.TemporaryDirectory() as generated:
        for relative, text in cuda_kernels.generated_headers().items():
            header = Path(generated) / relative
            header.parent.mkdir(parents=True, exist_ok=True)
            header.write_text(text)
        for source in cuda_kernels.kernel_sources():
            target = out / (source.stem + ".ptx")
            subprocess.run([str(compiler.find_nvcc()), *build_flags, "-ptx", "-gencode=arch=compute_90a,code=sm_90a",
                            f"-I{generated}", f"-I{cuda_kernels.INCLUDE_DIR}", *flags, "-o", str(target),
                            str(source)], check=True)
            written.append(target)
    return written


def instructions(path: Path) -> list[str]:
    """The PTX without `.loc`/`.file` lines and comments."""
    keep = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith((".loc", ".file", "//")):
            continue
        keep.append(line)
    return keep


def compare(before: Path, after: Path) -> dict[str, list[str]]:
    """Per source present in both folders: the differing lines as a unified diff (empty: identical)."""
    return {path.name: list(difflib.unified_diff(instructions(before / path.name), instructions(path), lineterm="",
                                                 n=0))[2:]
            for path in sorted(after.glob("*.ptx")) if (before / path.name).exists()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the .ptx files")
    parser.add_argument("--against", type=Path, default=None, help="an earlier --out folder to compare with")
    parser.add_argument("--flags", nargs="*", default=[], help="extra nvcc flags (a build variant)")
    args = parser.parse_args()
    write_ptx(args.out, args.flags)
    if args.against is None:
        return 0
    for name, diff in compare(args.against, args.out).items():
        changed = [line for line in diff if line[:1] in "+-" and not line.startswith("@@")]
        print(f"{name}: {'identical' if not changed else f'{len(changed)} lines differ'}")
        for line in diff[:40]:
            print("    " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
