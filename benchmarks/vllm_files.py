"""Copy the vllm==0.33.0 wheel's files that the vLLM-kernel stock runs (`glm5-decode bench
--stock vllm`, `benchmarks/kda_decode.py`, `benchmarks/moe_decode.py --vllm-ops`) out of an
installed vllm into one folder, with a manifest of their sha256: the folder to carry to a GPU
host without vLLM (`glm5_runtime.vllm_files.FILES` lists them; ~330 KB, ~70 KB as .tar.gz).

    python benchmarks/vllm_files.py vllm-files    # in an environment with vllm==0.33.0
    tar czf vllm-files.tar.gz vllm-files          # then, on the GPU host: tar xzf ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

from glm5_runtime.vllm_files import copy_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where the files go (made if missing)")
    args = parser.parse_args()
    manifest = copy_files(args.folder)
    size = sum((Path(args.folder) / p).stat().st_size for p in manifest["files"])
    print(f"{len(manifest['files'])} files of vLLM {manifest['vllm']}, {size / 1e3:.0f} KB, "
          f"in {args.folder}")  # fmt: skip


if __name__ == "__main__":
    main()
