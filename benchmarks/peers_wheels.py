"""The wheels benchmarks/peers.py carries to the GPU machine, which has torch 2.11, transformers 5.x and no internet.

    python benchmarks/peers_wheels.py .whl   # or: python benchmarks/peers.py wheels --out .whl

- ``.whl/*.whl``: foundry's own data path (mosaicml-streaming and its codecs), installed into ``/tmp/site``.
- ``.whl/peers/common``: what both peers import and the image lacks or has too new (datasets 3.6 and the
  huggingface_hub < 1.0 and fsspec it was written against).
- ``.whl/peers/titan``: torchtitan 0.2.2, the newest release before 0.3.0, which pins torch 2.14 (its
  docs/release.md); 0.2.2 imports and parses its config on torch 2.14 here.
- ``.whl/peers/llmf``: LLM Foundry 0.22 and Composer 0.32 with the transformers they pin (4.51; the image's 5.x
  lacks what they import), and each import they need that the image lacks (found by training LLM Foundry's
  ``mpt-small-cpu.yaml`` on a CPU with only the image's packages and these on the path). Installed without
  dependencies, so Composer's ``torch<2.7.1`` pin is not enforced: it runs on the image's torch.

Each list holds one version of a package; pure-Python wheels where they exist, else CPython 3.12 manylinux.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

FOUNDRY = ["mosaicml-streaming==0.13.0", "brotli==1.2.0", "python-snappy==0.7.3", "cramjam==2.11.0",
           "zstd==1.5.7.3", "catalogue==2.0.10"]  # fmt: skip
COMMON = ["datasets==3.6.0", "dill==0.3.8", "multiprocess==0.70.16", "huggingface_hub==0.36.0", "fsspec==2025.3.0"]
TITAN = ["torchtitan==0.2.2", "torchdata==0.11.0", "tyro==0.9.35", "docstring-parser==0.18.0", "shtab==1.13.0",
         "typeguard==4.6.1"]  # fmt: skip
LLMF = [
    "llm-foundry==0.22.0", "mosaicml==0.32.1", "mosaicml-cli==0.7.3", "transformers==4.51.3", "tokenizers==0.21.4",
    "omegaconf==2.3.0", "coolname==2.2.0", "torch_optimizer==0.3.0", "pytorch_ranger==0.1.1",
    "importlib-metadata==8.7.0", "setuptools==80.9.0", "tenacity==9.2.1", "mlflow-skinny==2.22.1",
    "databricks-sdk==0.162.0", "cachetools==5.5.2", "sqlparse==0.5.3", "backoff==2.2.1", "gql==4.4.0",
    "graphql-core==3.3.2", "websockets==15.0.1", "ruamel.yaml==0.18.14", "questionary==2.1.1",
    "prompt_toolkit==3.0.53", "wcwidth==0.2.13", "validators==0.36.0", "GitPython==3.1.45", "gitdb==4.0.12",
    "smmap==5.0.2", "beautifulsoup4==4.13.4", "soupsieve==2.7", "pydantic==2.11.7", "pydantic-core==2.33.2",
    "annotated-types==0.7.0", "typing-inspection==0.4.1", "opentelemetry-api==1.34.1", "opentelemetry-sdk==1.34.1",
    "opentelemetry-semantic-conventions==0.55b1", "google-auth==2.40.3", "pyasn1==0.6.5", "pyasn1_modules==0.4.2",
    "rsa==4.9.1",
]  # fmt: skip
# Built here from its source distribution (no wheel is published): a pure-Python wheel.
SDIST_ONLY = {"llmf": ["antlr4-python3-runtime==4.9.3"]}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]  # fmt: skip


def download(out: Path) -> None:
    """Every wheel of the lists above into ``out`` (foundry's) and ``out/peers/<group>``."""
    groups = {out: FOUNDRY, out / "peers" / "common": COMMON, out / "peers" / "titan": TITAN,
              out / "peers" / "llmf": LLMF}  # fmt: skip
    for folder, requirements in groups.items():
        folder.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM, "-d", str(folder)]
        subprocess.run([*pip, *requirements], check=True)
    for group, requirements in SDIST_ONLY.items():
        with tempfile.TemporaryDirectory() as source:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", source,
                            *requirements], check=True)  # fmt: skip
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out / "peers" / group),
                            *Path(source).iterdir()], check=True)  # fmt: skip


if __name__ == "__main__":
    download(Path(sys.argv[1]))
