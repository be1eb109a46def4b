"""Llama shapes that torchtitan's llama3 registry lacks, added through its ``--experimental.custom_import``.

torchtitan ships Llama-3 flavors from 8B up; the peers benchmark's one-GPU row needs the Llama-3.2-1B shape
that ``yamls/pretrain/llama-1b.yaml`` trains (d_model 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192,
vocabulary 128256), and the CPU smoke test a tiny one. Importing this module registers them as ``1B`` and
``peers_tiny``; everything else about the run stays torchtitan's.
"""

from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

# FFN: torchtitan's SwiGLU width int(2 * 4 * dim / 3) * 1.5, rounded up to a multiple of 1024 = 8192.
llama3_args["1B"] = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024, rope_theta=500000
)
llama3_args["peers_tiny"] = TransformerModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50304, rope_theta=500000
)
