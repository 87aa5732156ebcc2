"""Instructions per element and update in the ZO kernels' inner loop, counted in the code
compiled for a GPU architecture: no GPU needed, only Triton (CUDA builds of torch bring
it; on a CPU machine ``pip install --target DIR --no-deps triton`` and put DIR first on
PYTHONPATH).

Each kernel of kernels/zo_apply.py is compiled with ``triton.compile`` for ``--arch``
(default sm_90, Hopper), the SASS dumped with the ``cuobjdump`` that Triton ships, and the
innermost loop (the smallest backward branch: one update for a thread's elements; versions
3 and 4, one chunk of 8 or 4 updates) counted by opcode. Divided by the element-updates a
pass makes (block / (32 · warps) elements a thread, times the chunk's updates), that is the
instruction cost of one element and one update, what bounds the kernels once K updates
make them integer-bound (docs/performance.md): a static count, not a timing.

    python bench/zo_sass.py [--arch 90] [--blocks 1024,4096]
"""

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import zo_apply

SIGNATURE = {
    "theta_ptr": "*fp32",
    "n": "i32",
    "ka_ptr": "*i32",
    "kb_ptr": "*i32",
    "coeff_ptr": "*fp32",
    "bounds_ptr": "*i32",
    "num_groups": "i32",
    "BLOCK": "constexpr",
}
# Version 3's kernel takes the chunks' tables and the groups' chunk edges in those places.
SIGNATURE_V3 = {name.replace("coeff", "table").replace("bounds", "chunks"): kind for name, kind in SIGNATURE.items()}
UPDATES_PER_LOOP = {1: 1, 2: 1, 3: 8, 4: 4}
"""Updates one pass of the innermost loop applies (versions 3 and 4: a chunk's 8 or 4)."""
# What a launch on real tensors is specialized with: 16-byte aligned pointers and a
# size that is a multiple of 16 (256M parameters), as Triton's launcher would see them.
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(6)}
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);")


def sass(
    kernel: object,
    block: int,
    warps: int,
    arch: int,
    signature: dict[str, str] = SIGNATURE,
    options: dict[str, bool] | None = None,
) -> str:
    """``options``: the kernel's other constexprs (``apply_triton``'s choices)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = options or {}
    signature = signature | dict.fromkeys(options, "constexpr")
    source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": block, **options}, attrs=ALIGNED)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True, check=True).stdout


def innermost_loop(text: str) -> collections.Counter[str]:
    """Opcodes (without modifiers) of the loop closed by the shortest backward branch."""
    found = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(INSTRUCTION.match, text.splitlines()) if m]
    loops = []
    for address, op, rest in found:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < address:
            loops.append((address - int(target.group(1), 16), int(target.group(1), 16), address))
    if not loops:
        raise RuntimeError("no loop in the compiled kernel")
    _, start, end = min(loops)
    return collections.Counter(op.split(".")[0] for address, op, _ in found if start <= address <= end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100/H200)")
    parser.add_argument("--blocks", default="1024,4096")
    args = parser.parse_args()
    if zo_apply.triton is None:
        parser.error("needs Triton (see the docstring)")
    kernels = {
        1: zo_apply._apply_kernel,
        2: zo_apply._apply_v2_kernel,
        3: zo_apply._apply_v3_kernel,
        4: zo_apply._apply_v4_kernel,
    }
    rows = []
    per_element: dict[tuple[int, int], float] = {}
    blocks = [int(b) for b in args.blocks.split(",")]
    for block in blocks:
        for version, kernel in kernels.items():
            warps = zo_apply.num_warps_for(block, version)
            signature = SIGNATURE_V3 if version in zo_apply.CHUNK_UPDATES else SIGNATURE
            options = {} if version == 1 else {"COALESCED": zo_apply.COALESCED_TILES}
            if version == 4:
                options["SHUFFLE"] = True
            counts = innermost_loop(sass(kernel, block, warps, args.arch, signature, options))
            elements = max(1, block // (32 * warps)) * UPDATES_PER_LOOP[version]
            total = sum(counts.values())
            per_element[(block, version)] = total / elements
            rows.append(
                {
                    "version": version,
                    "block": block,
                    "num_warps": warps,
                    "element_updates_per_loop": elements,
                    "loop_instructions": total,
                    "per_element_update": round(total / elements, 2),
                    "opcodes": dict(counts.most_common()),
                }
            )
    ratios = {f"v1_over_v2_block_{b}": round(per_element[(b, 1)] / per_element[(b, 2)], 2) for b in blocks}
    ratios |= {f"v2_over_v3_block_{b}": round(per_element[(b, 2)] / per_element[(b, 3)], 2) for b in blocks}
    ratios |= {f"v2_over_v4_block_{b}": round(per_element[(b, 2)] / per_element[(b, 4)], 2) for b in blocks}
    print(json.dumps({"bench": "zo_sass", "arch": args.arch, "rows": rows, **ratios}, indent=1))


if __name__ == "__main__":
    main()
