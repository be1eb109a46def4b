"""FlashAttention-2 for LLM Foundry's peers rows, built on the GPU machine from flash-attn's source distribution.

LLM Foundry's ``mpt-1b.yaml`` asks for ``attn_impl: flash`` and ``loss_fn: fused_crossentropy``, both from
flash-attn, which publishes no wheel for the GPU image's torch 2.11 / CUDA 13; without it the LLM Foundry rows
run its ``torch`` attention and are no fair comparison. Its source builds there (the image has nvcc 13.0 and
ninja), but all of it takes longer than a call, so this builds what the rows run: the head_dim 128 kernels in
bf16 for Hopper (forward, backward, split-KV forward, causal and not: 6 of its 73 CUDA files). The build's
dispatch is narrowed to match (``patch``): any other head size or fp16 fails with a message, never a missing
symbol or a wrong kernel. The fused cross-entropy is flash-attn's Triton kernel and needs no build.

Here, once (the source, 8.4 MB, from the package registry):

    python benchmarks/peers_flash_attn.py fetch --out .whl/peers/flash-attn-src

On one GPU (1× H100 80GB, with .whl copied there; about 5 minutes): the wheel, in parts of at most 15 MiB each

    python3 benchmarks/peers_flash_attn.py build --src .whl/peers/flash-attn-src --out OUT_DIR

Here: the parts back into one wheel, where ``peers.py`` installs LLM Foundry's environment from

    python benchmarks/peers_flash_attn.py join OUT_DIR --out .whl/peers/llmf
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "2.8.3"
WHEEL_VERSION = "0.45.1"
HEAD_DIM = 128
KERNELS = [
    f"csrc/flash_attn/src/flash_{kind}_hdim{HEAD_DIM}_bf16{causal}_sm80.cu"
    for kind in ("fwd", "bwd", "fwd_split")
    for causal in ("", "_causal")
]
PART_BYTES = 15 * 1024 * 1024  # under a 16 MiB limit on each file copied back from the GPU machine
ONLY = f"this flash-attn build (benchmarks/peers_flash_attn.py) has the bf16 head_dim {HEAD_DIM} kernels only"
SWITCHES = f"""#define FP16_SWITCH(COND, ...)                                   \\
  [&] {{                                                          \\
    TORCH_CHECK(!(COND), "{ONLY}: got fp16");                     \\
    using elem_type = cutlass::bfloat16_t;                       \\
    return __VA_ARGS__();                                        \\
  }}()

#define HEADDIM_SWITCH(HEADDIM, ...)                             \\
  [&] {{                                                          \\
    TORCH_CHECK(HEADDIM > 96 && HEADDIM <= {HEAD_DIM}, "{ONLY}: got head_dim ", HEADDIM); \\
    constexpr static int kHeadDim = {HEAD_DIM};                   \\
    return __VA_ARGS__();                                        \\
  }}()
"""


def fetch(out: Path) -> Path:
    """flash-attn's source distribution from the package registry (its metadata needs torch: no isolation), and
    the ``wheel`` package its setup.py imports, which an image may lack."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(out)]
    subprocess.run([*pip, "--no-binary", ":all:", "--no-build-isolation", f"flash-attn=={VERSION}"], check=True)
    subprocess.run([*pip, "--only-binary", ":all:", f"wheel=={WHEEL_VERSION}"], check=True)  # setup.py imports it
    return out / f"flash_attn-{VERSION}.tar.gz"


def patch(tree: Path, cxx20: bool = False) -> None:
    """Narrow the build to ``KERNELS``: setup.py compiles only them, the dispatch in flash_api.cpp reaches only them.

    ``cxx20``: compile as C++20, which torch's headers require from torch 2.13 (flash-attn 2.8.3 pins C++17)."""
    setup = tree / "setup.py"
    text = setup.read_text()
    if cxx20:
        text = text.replace('"-std=c++17"', '"-std=c++20"')
    listed = re.findall(r'"(csrc/flash_attn/src/flash_[a-z_]+hdim\d+_(?:fp16|bf16)[a-z_]*_sm80\.cu)",\n', text)
    missing = sorted(set(KERNELS) - set(listed))
    if missing or not listed:
        raise SystemExit(f"{setup}: the kernel list is not as flash-attn {VERSION} has it (missing {missing})")
    for source in set(listed) - set(KERNELS):
        text = re.sub(rf'\n\s*"{re.escape(source)}",', "", text, count=1)
    setup.write_text(text)
    switch = tree / "csrc/flash_attn/src/static_switch.h"
    text = switch.read_text()
    start, end = text.find("#define FP16_SWITCH"), text.find("#define HEADDIM_SWITCH")
    end = text.find("}()", end)
    if start < 0 or end < 0:
        raise SystemExit(f"{switch}: FP16_SWITCH / HEADDIM_SWITCH are not as flash-attn {VERSION} has them")
    switch.write_text(text[:start] + SWITCHES + text[end + len("}()") :])


def build(src: Path, out: Path, jobs: int) -> list[Path]:
    """Build the narrowed wheel for Hopper (sm_90) and write it to ``out`` in parts with a manifest."""
    sdist = next(src.glob(f"flash_attn-{VERSION}.tar.gz"), None)
    if sdist is None:
        raise SystemExit(f"no flash_attn-{VERSION}.tar.gz in {src}: run `peers_flash_attn.py fetch --out {src}` here")
    work = Path(tempfile.mkdtemp(prefix="flash-attn-"))
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    tree = work / f"flash_attn-{VERSION}"
    import torch  # the build's torch: the GPU image's

    patch(tree, cxx20=tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13))
    env = {**os.environ, "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_CUDA_ARCHS": "90",
           "MAX_JOBS": str(jobs), "NVCC_THREADS": "4"}  # fmt: skip
    if importlib.util.find_spec("wheel") is None:  # its setup.py imports it; `fetch` brings it along
        site = work / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                        *map(str, src.glob("wheel-*.whl"))], check=True)  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    wheels = work / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(tree)], check=True, env=env)  # fmt: skip
    wheel = next(wheels.glob("flash_attn-*.whl"))
    return split(wheel, out)


def split(wheel: Path, out: Path) -> list[Path]:
    """``wheel`` as ``<name>.part<i>`` files of at most PART_BYTES and ``<name>.json`` (parts, size, sha256)."""
    out.mkdir(parents=True, exist_ok=True)
    data = wheel.read_bytes()
    parts = []
    for index in range(0, max(len(data), 1), PART_BYTES):
        part = out / f"{wheel.name}.part{index // PART_BYTES}"
        part.write_bytes(data[index : index + PART_BYTES])
        parts.append(part)
    manifest = {"wheel": wheel.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "parts": [part.name for part in parts]}  # fmt: skip
    (out / f"{wheel.name}.json").write_text(json.dumps(manifest, indent=1))
    return parts


def join(folder: Path, out: Path) -> Path:
    """The wheel from ``split``'s parts under ``folder`` (searched recursively), checked against its manifest."""
    manifests = sorted(folder.rglob("flash_attn-*.whl.json"))
    if not manifests:
        raise SystemExit(f"no flash_attn-*.whl.json under {folder}: the build's parts did not come back")
    manifest = json.loads(manifests[-1].read_text())
    data = b"".join((manifests[-1].parent / name).read_bytes() for name in manifest["parts"])
    if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit(f"{manifests[-1]}: the joined parts do not match the manifest (a part is missing or cut)")
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / manifest["wheel"]
    wheel.write_bytes(data)
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_parser = commands.add_parser("fetch", help="download the source distribution (here)")
    fetch_parser.add_argument("--out", required=True)
    build_parser = commands.add_parser("build", help="build the narrowed wheel (on the GPU machine)")
    build_parser.add_argument("--src", required=True, help="the folder `fetch` wrote")
    build_parser.add_argument("--out", required=True)
    build_parser.add_argument("--jobs", type=int, default=len(KERNELS) + 1, help="parallel compilations")
    join_parser = commands.add_parser("join", help="the wheel from the parts a call returned (here)")
    join_parser.add_argument("folder")
    join_parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "fetch":
        print(fetch(Path(args.out)))
    elif args.command == "build":
        if shutil.which("nvcc") is None:
            raise SystemExit(
                "no nvcc on this machine: `build` runs on the GPU machine, whose image has CUDA's compiler"
            )
        print("\n".join(map(str, build(Path(args.src), Path(args.out), args.jobs))))
    else:
        print(join(Path(args.folder), Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
