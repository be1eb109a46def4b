"""benchmarks/peers_flash_attn.py: the narrowed build's source patch and the wheel's parts, without building."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peers_flash_attn

OTHER_KERNELS = [
    "csrc/flash_attn/src/flash_fwd_hdim64_fp16_sm80.cu",
    "csrc/flash_attn/src/flash_bwd_hdim256_bf16_sm80.cu",
]
# the two macros as flash-attn 2.8.3's static_switch.h has them, between macros the patch leaves alone
SWITCH_H = """#define BOOL_SWITCH(COND, CONST_NAME, ...) [&] { return __VA_ARGS__(); }()

#define FP16_SWITCH(COND, ...)               \\
  [&] {                                      \\
    if (COND) {                              \\
      using elem_type = cutlass::half_t;     \\
      return __VA_ARGS__();                  \\
    } else {                                 \\
      using elem_type = cutlass::bfloat16_t; \\
      return __VA_ARGS__();                  \\
    }                                        \\
  }()

#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    if (HEADDIM <= 32) {                   \\
      constexpr static int kHeadDim = 32;  \\
      return __VA_ARGS__();                \\
    } else if (HEADDIM <= 256) {           \\
      constexpr static int kHeadDim = 256; \\
      return __VA_ARGS__();                \\
    }                                      \\
  }()
"""


def source_tree(tmp_path: Path, kernels: list[str]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    listed = "".join(f'                "{kernel}",\n' for kernel in kernels)
    api = '                "csrc/flash_attn/flash_api.cpp",\n'
    flags = 'nvcc_flags = ["-O3", "-std=c++17"]\ncompiler_c17_flag = ["-O3", "-std=c++17"]\n'
    (tmp_path / "setup.py").write_text(f"{flags}sources=[\n{api}{listed}            ]\n")
    switch = tmp_path / "csrc/flash_attn/src/static_switch.h"
    switch.parent.mkdir(parents=True)
    switch.write_text(SWITCH_H)
    return tmp_path


def test_the_patch_builds_the_bf16_head_dim_128_kernels_only_and_dispatches_nothing_else(tmp_path: Path) -> None:
    tree = source_tree(tmp_path, [OTHER_KERNELS[0], *peers_flash_attn.KERNELS, OTHER_KERNELS[1]])
    peers_flash_attn.patch(tree)
    setup = (tree / "setup.py").read_text()
    assert all(kernel in setup for kernel in peers_flash_attn.KERNELS) and "flash_api.cpp" in setup
    assert not any(kernel in setup for kernel in OTHER_KERNELS)
    switch = (tree / "csrc/flash_attn/src/static_switch.h").read_text()
    assert switch.startswith("#define BOOL_SWITCH")
    assert "cutlass::half_t" not in switch and "kHeadDim = 32" not in switch
    assert 'TORCH_CHECK(HEADDIM > 96 && HEADDIM <= 128, "this flash-attn build' in switch
    assert switch.count("}()") == 3  # BOOL_SWITCH's and the two new macros'


def test_a_source_tree_unlike_the_expected_release_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="kernel list is not as flash-attn 2.8.3 has it"):
        peers_flash_attn.patch(source_tree(tmp_path, OTHER_KERNELS))


def test_the_wheel_travels_in_parts_and_a_cut_part_is_caught(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(peers_flash_attn, "PART_BYTES", 10)
    wheel = tmp_path / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(bytes(range(25)))
    parts = peers_flash_attn.split(wheel, tmp_path / "out" / "a")
    assert [part.stat().st_size for part in parts] == [10, 10, 5]
    joined = peers_flash_attn.join(tmp_path / "out", tmp_path / "joined")
    assert joined.read_bytes() == wheel.read_bytes() and joined.name == wheel.name
    parts[-1].write_bytes(b"cut")
    with pytest.raises(SystemExit, match="do not match the manifest"):
        peers_flash_attn.join(tmp_path / "out", tmp_path / "again")


def test_torch_headers_that_need_cxx20_get_it_and_older_ones_keep_cxx17(tmp_path: Path) -> None:
    for cxx20, standard in ((False, "c++17"), (True, "c++20")):
        tree = source_tree(tmp_path / standard, peers_flash_attn.KERNELS)
        peers_flash_attn.patch(tree, cxx20=cxx20)
        assert (tree / "setup.py").read_text().count(f'"-std={standard}"') == 2
