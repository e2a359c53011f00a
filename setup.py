"""Build megatron-omnibal with its C++ balancing core (pybind11)."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext_modules = [
    Pybind11Extension(
        "megatron_omnibal._balance_core",
        sorted(["csrc/balance_core.cpp"]),
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(
    name="megatron-omnibal",
    version="0.1.0",
    description="Balanced data, model partition and recompute for VLM training on Megatron-LM",
    packages=find_packages(include=["megatron_omnibal", "megatron_omnibal.*"]),
    package_data={"megatron_omnibal": ["py.typed"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "tqdm>=4.60"],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        "stats": ["pillow>=10", "tokenizers>=0.15", "transformers>=4.40"],
        "megatron": ["torch>=2.6", "megatron-core>=0.19"],
    },
    entry_points={"console_scripts": ["omnibal=megatron_omnibal.cli:main"]},
)
