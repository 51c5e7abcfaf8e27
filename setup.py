"""Install gloader: `pip install -e '.[test]'` for development."""
from setuptools import find_packages, setup

setup(
    name="gloader",
    version="0.1.0",
    description="Gluon-style, pool-based data loader for PyTorch with shared-memory batches",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gloader", "gloader.*"]),
    package_data={"gloader": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.23",
        # A range that the local CPU build 2.13 satisfies; .ci/run installs that build first
        # so pip never reaches for a multi-GB CUDA wheel.
        "torch>=2.1,<3",
        # Capped: gloader's pool uses three names of multiprocess that are not its API (see
        # gloader/_pool/processes.py and channel.py), checked by the tests against the release installed.
        "multiprocess>=0.70.15,<0.71",
    ],
    extras_require={
        "test": [
            "pytest>=7.4",
            "pytest-timeout>=2.2",
            # Two test processes (pytest.ini): the suite waits on workers, deadlines and
            # subprocesses half its time; xdist runs tests side by side, which we would not rebuild.
            "pytest-xdist>=3.5",
            "hypothesis>=6.80",
            "psutil>=5.9",
            "nbclient>=0.9",
            "nbformat>=5.9",
            "ipykernel>=6.25",
            "mypy>=1.8",
            "ruff>=0.4",
            "matplotlib>=3.7",
            "pillow>=9.1",
            # Accelerate: the tests run examples/accelerate_ddp.py under a real 2-process launch,
            # since its prepare() is where users meet gloader (pure Python; uses the torch installed).
            "accelerate>=1.0",
            # The trainers themselves, which tests/test_in_trainers.py runs as users do (their own
            # hooks, seeding and resume are what a stand-in cannot reproduce); both use the torch installed.
            "lightning>=2.2",
            "transformers>=4.40",
        ],
        # gloader.integrations: Accelerate's gradient state and gather_for_metrics, the Trainer's resume.
        "accelerate": ["accelerate>=1.0"],
        "transformers": ["transformers>=4.40", "accelerate>=1.0"],
        # MkDocs builds the site in docs/; mkdocstrings writes its API reference from the docstrings.
        "docs": ["mkdocs>=1.6,<2", "mkdocstrings[python]>=0.26"],
        # tensorpack: a peer the benchmark compares with (W1, W2); pillow: W8's JPEGs; Ray Data:
        # W12's peer (gloader on Ray beside it).
        "bench": ["matplotlib>=3.7", "psutil>=5.9", "pillow>=9.1", "tensorpack>=0.11", "ray[data]>=2.9"],
        # RayPool: the loader's workers as Ray actors across a cluster (only imported when used).
        "ray": ["ray>=2.9"],
    },
)
