"""What a GPU node without network access needs beside the working tree (gpu_bundle/, ignored by
git): the wheels its Python image lacks and the shards every part uses. Built where there is a
network (`session.py prepare`), checked before every plan (`session.py check`, and `run` itself):
complete for the node's Python, and with the tree under 64 MiB, so a copy to the node stays small."""
from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from commodity_bert.host import speaker

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "gpu_bundle"  # ignored by git; copied to the device beside the tree
LIMIT_MIB = 64  # the working tree plus the bundle, as copied to the device

# The Python packages already on the device's image (its package list as read 2026-11-17), as
# distribution names normalised by `normalise`. The bundle holds the rest.
DEVICE_PACKAGES = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())  # noqa: SIM905 - the list as the image's package list gives it
# What the device lacks and the session imports: deepspeed (built here into a wheel with no
# compiled ops; it JIT-builds what it needs there) and what it needs. typing-extensions is
# there, but perhaps older than this pydantic asks (>= 4.16), so it travels too.
CARRIED = ["deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
           "typing-extensions"]
DEVICE_PYTHON = ("3.12", "cp312")


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


say = speaker("session")


def prepare(bundle: Path, corpus: Path | None = None) -> dict:
    """gpu_bundle/wheels: what DEVICE_PACKAGES lacks, for the device's Python, at the versions this
    environment runs (so the rehearsal tests the same set); gpu_bundle/data: the shards every part
    uses. Writes to temporary names and renames, so a failed prepare leaves the old bundle whole."""
    bundle.mkdir(parents=True, exist_ok=True)
    wheels_tmp = bundle / "wheels.tmp"
    shutil.rmtree(wheels_tmp, ignore_errors=True)
    wheels_tmp.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    pinned = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED if name != "deepspeed"]
    platforms = [x for n in (17, 24, 27, 28, 31, 34) for x in ("--platform", f"manylinux_2_{n}_x86_64")]
    run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON[0],
         "--implementation", "cp", *platforms, "--platform", "manylinux2014_x86_64", "-d", str(wheels_tmp),
         *pinned])
    # DeepSpeed publishes no wheel; built against this torch with no ops compiled (pure Python):
    # the device JIT-builds the ops it uses, for its own torch and CUDA
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels_tmp),
         f"deepspeed=={importlib.metadata.version('deepspeed')}"])
    shutil.rmtree(bundle / "wheels", ignore_errors=True)
    wheels_tmp.rename(bundle / "wheels")

    data_tmp = bundle / "data.tmp"
    shutil.rmtree(data_tmp, ignore_errors=True)
    # the embedded BERT-base vocabulary: what users pretrain with; MFU counts its head
    make_shards("embedded:sotu", data_tmp)
    shutil.rmtree(bundle / "data", ignore_errors=True)
    data_tmp.rename(bundle / "data")
    # the rehearsal's: the same text with a 2,048-token vocabulary, so that `tiny`'s checkpoints
    # and exports (most of them its embedding table) cost the CPU seconds, not minutes; and a
    # validation split of one address (76 sequences, not 668): every run of the rehearsal ends in
    # an evaluation, and 668 made them most of its time on a CPU
    rehearsal_tmp = bundle / "rehearsal_data.tmp"
    shutil.rmtree(rehearsal_tmp, ignore_errors=True)
    rehearsal_tmp.mkdir()
    run([sys.executable, "-m", "data_prep", "vocab", "--input", "embedded:sotu", "--vocab-size", "2048",
         "--output", str(rehearsal_tmp / "vocab.txt")], cwd=REPO)
    make_shards("embedded:sotu", rehearsal_tmp / "shards", "--vocab", str(rehearsal_tmp / "vocab.txt"),
                num_shards="2", val_fraction="0.006")
    shutil.rmtree(bundle / "rehearsal_data", ignore_errors=True)
    rehearsal_tmp.rename(bundle / "rehearsal_data")
    if corpus is not None:
        prepare_corpus(bundle, corpus)
    report = check_bundle(bundle)
    say(f"prepared {bundle}: {len(report['wheels'])} wheels, bundle {report['bundle_mib']:.1f} MiB, "
        f"tree {report['tree_mib']:.1f} MiB (limit {LIMIT_MIB})")
    return report


def prepare_corpus(bundle: Path, corpus: Path) -> None:
    """gpu_bundle/corpus: part c's shards from the prose corpus (`bert-data-prep corpus`, built
    into `corpus` first where it is not there), seq 128, dynamic masking, no NSP, the BERT vocabulary."""
    if not (corpus / "corpus.txt").is_file():
        run([sys.executable, "-m", "data_prep", "corpus", "--output", str(corpus)], cwd=REPO)
    tmp = bundle / "corpus.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_shards(str(corpus / "corpus.txt"), tmp, val_fraction="0.01")
    shutil.copy(corpus / "manifest.json", tmp / "corpus_manifest.json")
    shutil.rmtree(bundle / "corpus", ignore_errors=True)
    tmp.rename(bundle / "corpus")


def make_shards(text: str, output: Path, *extra: str, val_fraction: str = "0.02", num_shards: str = "4") -> None:
    """The session's shards: seq 128, dynamic masking (each pass over the corpus masks anew: part c
    passes many times), no NSP, seed 1; the BERT-base vocabulary unless `extra` names another."""
    run([sys.executable, "-m", "data_prep", "shards", "--input", text, "--seq-len", "128", "--masking", "dynamic",
         "--no-nsp", "--num-shards", num_shards, "--val-fraction", val_fraction, "--seed", "1", *extra,
         "--output", str(output)], cwd=REPO)


def run(cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"session.py: error: {' '.join(cmd[:6])} ... failed: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def tree_bytes() -> int:
    """What the device gets besides the bundle: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def carried_closure_gaps() -> list[str]:
    """What the carried packages need (their requirements, recursively, extras left out) that is
    neither on the device nor carried: a gap means an ImportError there."""
    from packaging.requirements import Requirement
    gaps, seen, todo = set(), set(), [normalise(n) for n in CARRIED]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": "", "python_version": DEVICE_PYTHON[0],
                                                      "sys_platform": "linux", "platform_system": "Linux"}):
                continue
            needed = normalise(req.name)
            if needed in {normalise(n) for n in CARRIED}:
                todo.append(needed)
            elif needed not in DEVICE_PACKAGES:
                gaps.add(f"{needed} (for {name})")
    return sorted(gaps)


def project_needs_absent_on_device() -> list[str]:
    """The project's own requirements that the device lacks and the bundle leaves out (datasets,
    blingfire): no part may import them."""
    import tomllib
    from packaging.requirements import Requirement
    # from pyproject.toml: the project is not installed on the device, only its tree travels
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needs = [Requirement(r) for r in project["dependencies"]]
    carried = {normalise(n) for n in CARRIED}
    return sorted({normalise(r.name) for r in needs} - DEVICE_PACKAGES - carried)


def check_bundle(bundle: Path) -> dict:
    """Is the bundle complete (a wheel for every CARRIED name, for the device's Python) and does it
    fit beside the tree? Raises SystemExit with one line if not."""
    wheels = sorted(p.name for p in (bundle / "wheels").glob("*.whl"))
    names = {normalise(w.split("-")[0]) for w in wheels}
    missing = [n for n in CARRIED if normalise(n) not in names]
    if missing:
        raise SystemExit(f"session.py: error: {bundle}/wheels lacks {', '.join(missing)}; "
                         f"run: python benchmarks/gpu/session.py prepare")
    wrong = [w for w in wheels if not (w.endswith("-none-any.whl") or f"-{DEVICE_PYTHON[1]}-" in w)]
    if wrong:
        raise SystemExit(f"session.py: error: {', '.join(wrong)} will not install on the device's Python "
                         f"{DEVICE_PYTHON[0]}; run: python benchmarks/gpu/session.py prepare")
    gaps = carried_closure_gaps()
    if gaps:
        raise SystemExit(f"session.py: error: the carried wheels need {', '.join(gaps)}, which the device lacks; "
                         f"add them to CARRIED in benchmarks/gpu/session.py")
    if not all((bundle / d / "manifest.json").is_file() for d in ("data", "rehearsal_data/shards")):
        raise SystemExit(f"session.py: error: no shards in {bundle}/data; run: python benchmarks/gpu/session.py prepare")
    bundle_bytes = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    tree = tree_bytes()
    if bundle_bytes + tree > LIMIT_MIB * 2**20:
        raise SystemExit(f"session.py: error: the tree ({tree / 2**20:.1f} MiB) and {bundle} "
                         f"({bundle_bytes / 2**20:.1f} MiB) exceed the device's {LIMIT_MIB} MiB")
    return {"wheels": wheels, "bundle_mib": bundle_bytes / 2**20, "tree_mib": tree / 2**20}
