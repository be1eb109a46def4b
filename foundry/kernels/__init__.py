"""Triton kernels (forward + backward, as autograd Functions) behind the ``fused_kernels`` algorithm.

Each kernel matches a PyTorch layer of ``foundry.models`` and is tested against it under
``TRITON_INTERPRET=1``; ``device.py`` says where they run and how they size their launches.
Import the submodules directly (``foundry.kernels.norm``, ...): they need Triton.
"""
