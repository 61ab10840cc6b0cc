"""megatron_snip: Megatron-style Llama pretraining with SNIP adaptive per-GEMM precision.

CPU install (the pin takes the local CPU wheel, not a multi-GB CUDA build):
    pip install torch==2.13.0 && pip install -e ".[dev]"
GPU install: install a CUDA build of torch first (https://pytorch.org), then
    pip install -e ".[gpu]"   # adds transformer-engine[pytorch]
Triton quantize kernels: pip install -e ".[kernels]" (CUDA torch wheels already depend on triton).
NVIDIA apex is not used: on CUDA the optimizer is torch's fused AdamW (training/optim.py).
"""

from setuptools import find_packages, setup

setup(
    name="megatron_snip",
    version="0.1.0",
    description="Megatron-style Llama pretraining that picks BF16/FP8/FP4 per GEMM with SNIP",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_snip", "megatron_snip.*", "snip_kernels", "snip_kernels.*"]),
    package_data={"megatron_snip.data": ["sample/*"]},
    include_package_data=True,
    install_requires=[
        # torch is deliberately unpinned here: CPU users pin torch==2.13.0 before installing
        # (see README); GPU users bring their CUDA build. >=2.5 for enable_gqa in SDPA.
        "torch>=2.5",
        "numpy>=1.24",
        "ortools>=9.10",
        "tokenizers>=0.15",
        "safetensors>=0.4",  # Hugging Face checkpoints (interop/hf.py)
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "wandb>=0.17",
    ],
    extras_require={
        # transformers: the reference the HF import/export tests compare against (never imported at run time)
        "dev": ["pytest>=7", "ml_dtypes>=0.4", "scipy>=1.10", "transformers>=4.45", "tensorboard>=2.14",
                "ruff==0.17.6"],  # CI runs ruff check . (pinned: new releases add rules)
        "gpu": ["transformer-engine[pytorch]>=2.8"],
        # Triton quantize kernels (snip_kernels/): used on CUDA tensors; CI runs their tests on CPU
        # under the Triton interpreter. CUDA builds of torch bring a matching triton already.
        "kernels": ["triton>=3.6"],
        # logging.tensorboard (telemetry/tensorboard_sink.py)
        "tensorboard": ["tensorboard>=2.14"],
        # the standard harness on exported checkpoints (README "Evaluating checkpoints"; CI runs its test)
        "eval": ["lm_eval>=0.4", "accelerate>=0.26"],
    },
    entry_points={"console_scripts": ["megatron-snip=megatron_snip.train:main"]},
)
