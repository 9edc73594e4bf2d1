"""Build the model repositories Triton's test.sh files build.

- ``python_model``: test.sh's ``mkdir -p models/X/1; cp ../python_models/Y/model.py ...``.
- ``sed``/``append``: its ``sed -i`` and ``echo ... >> config.pbtxt`` edits.
- ``generated``: a model test.sh copies from Triton's pre-generated ``/data/inferenceserver``
  repositories, made here by Triton's own generators (qa/common/gen_qa_models.py and
  gen_qa_identity_models.py, ONNX only), so names, tensors, datatypes and dims are theirs.
- ``as_libtorch``: a generated ONNX model renamed to its libtorch twin (same name and
  INPUT__0-style tensor names as gen_qa_models.py's libtorch model, same arithmetic).
- ``example``: a model of Triton's docs/examples/model_repository (what Dockerfile.QA copies into
  qa/L0_*/models), from the directory given with --examples or, without it, this project's
  configs/models, which holds models of the same names and interfaces.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
OWN_EXAMPLES = os.path.join(ROOT, "configs", "models")

# generator -> the flags Triton's gen_qa_model_repository passes it (ONNX part)
_GENERATORS = {
    "qa_model_repository": ("gen_qa_models.py", ["--onnx"]),
    "qa_identity_model_repository": ("gen_qa_identity_models.py", ["--onnx"]),
}


class Missing(Exception):
    """A model this run cannot provide; the cases that need it are skipped with the message."""


def python_model(qa: str, src: str, repo: str, name: str | None = None,
                 model_file: str = "model.py", config: str | None = "config.pbtxt",
                 files: tuple[str, ...] = ()) -> str:
    """models/<name>/1/model.py and models/<name>/config.pbtxt from qa/python_models/<src>."""
    name = name or src
    srcdir = os.path.join(qa, "python_models", src)
    dst = os.path.join(repo, name)
    os.makedirs(os.path.join(dst, "1"), exist_ok=True)
    shutil.copy(os.path.join(srcdir, model_file), os.path.join(dst, "1", "model.py"))
    for extra in files:
        shutil.copy(os.path.join(srcdir, extra), os.path.join(dst, "1", os.path.basename(extra)))
    if config:
        shutil.copy(os.path.join(srcdir, config), os.path.join(dst, "config.pbtxt"))
    return dst


def sed(path: str, pattern: str, repl: str, count: int = 0) -> None:
    """``sed -i "s/pattern/repl/[g]"`` (a Python regex, per line; count=1 for no ``g``)."""
    with open(path) as f:
        lines = f.read().split("\n")
    out = [re.sub(pattern, repl, line, count=count) for line in lines]
    with open(path, "w") as f:
        f.write("\n".join(out))


def sed_first(path: str, pattern: str, repl: str) -> None:
    """``sed -i "0,/pattern/{s/pattern/repl/}"``: only the first match in the file."""
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(re.sub(pattern, repl, text, count=1))


def append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def rename(config_dir: str, name: str) -> None:
    """``sed -i "s/^name:.*/name: \\"<name>\\"/" config.pbtxt``"""
    sed(os.path.join(config_dir, "config.pbtxt"), r"^name:.*", f'name: "{name}"')


def copytree(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=False, dirs_exist_ok=True)
    return dst


def generated(ctx, repository: str, model: str, dest_repo: str, name: str | None = None,
              only_version: str | None = None) -> str:
    """Copy ``model`` of Triton's ``repository`` (qa_model_repository, ...) into ``dest_repo``
    (with ``only_version``: that version folder and the files beside the versions, as test.sh's
    ``cp -r $DATADIR/.../<model>/1 ...``)."""
    cache = os.path.join(ctx.work, "generated", repository)
    if not os.path.isdir(cache):
        script, flags = _GENERATORS[repository]
        common = os.path.join(ctx.qa, "common")
        done = subprocess.run([sys.executable, os.path.join(common, script), *flags,
                               f"--models_dir={cache}"], cwd=common, capture_output=True,
                              text=True, timeout=600, env=ctx.env())
        if done.returncode != 0:
            shutil.rmtree(cache, ignore_errors=True)
            raise Missing(f"Triton's {script} --onnx failed: {done.stderr.strip()[-300:]}")
    src = os.path.join(cache, model)
    if not os.path.isdir(src):
        raise Missing(f"needs Triton's generated model {model} ({repository}), which "
                      "its generator does not make with --onnx")
    dst = copytree(src, os.path.join(dest_repo, name or model))
    if only_version:
        for entry in os.listdir(dst):
            if entry.isdigit() and entry != only_version:
                shutil.rmtree(os.path.join(dst, entry))
    return dst


def as_libtorch(ctx, model: str, dest_repo: str) -> str:
    """``libtorch_[nobatch_]<in>_<in>_<out>`` as ONNX: gen_qa_models.py's ONNX model of the same
    arithmetic, its outputs renamed OUTPUT__0/OUTPUT__1 as the libtorch generator names them
    (its inputs keep INPUT0/INPUT1), its dims left free as a TorchScript model's are."""
    import onnx
    onnx_name = model.replace("libtorch", "onnx", 1)
    dst = generated(ctx, "qa_model_repository", onnx_name, dest_repo, name=model)
    names = {f"OUTPUT{i}": f"OUTPUT__{i}" for i in range(4)}
    for version in os.listdir(dst):
        path = os.path.join(dst, version, "model.onnx")
        if not os.path.isfile(path):
            continue
        m = onnx.load(path)
        for vi in m.graph.output:
            vi.name = names.get(vi.name, vi.name)
        for vi in [*m.graph.input, *m.graph.output]:        # TorchScript takes any shape
            for k, dim in enumerate(vi.type.tensor_type.shape.dim):
                dim.dim_param = f"{vi.name}_d{k}"
        for node in m.graph.node:
            node.input[:] = [names.get(n, n) for n in node.input]
            node.output[:] = [names.get(n, n) for n in node.output]
        onnx.save(m, path)
    cfg = os.path.join(dst, "config.pbtxt")
    rename(dst, model)
    for old, new in names.items():
        sed(cfg, rf'name: "{old}"', f'name: "{new}"')
    return dst


def example(ctx, model: str, dest_repo: str, name: str | None = None) -> str:
    """A model of Triton's docs/examples/model_repository (or this project's equivalent)."""
    for base in (ctx.examples, OWN_EXAMPLES):
        if base and os.path.isdir(os.path.join(base, model, "1")):
            return copytree(os.path.join(base, model), os.path.join(dest_repo, name or model))
    raise Missing(f"needs Triton's example model {model} (docs/examples/model_repository)")


def python_backend_example(ctx, path: str) -> str:
    """A file of python_backend's examples/ (given with --python-backend)."""
    if not ctx.python_backend:
        raise Missing(f"needs python_backend's examples/{path} (pass --python-backend)")
    full = os.path.join(ctx.python_backend, "examples", path)
    if not os.path.exists(full):
        raise Missing(f"python_backend has no examples/{path}")
    return full


def shell_block(test_sh: str, after: str, until: str, cwd: str) -> None:
    """Run, with bash in ``cwd``, the lines of ``test_sh`` that follow the first line holding
    ``after`` up to the first line matching the regex ``until``: the echo/heredoc model configs
    some test.sh files write, taken verbatim."""
    with open(test_sh) as f:
        lines = f.read().split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if after in line) + 1
        end = next(i for i in range(start, len(lines)) if re.search(until, lines[i]))
    except StopIteration:
        raise Missing(f"{test_sh} changed: no block after '{after}' ending at /{until}/") from None
    script = "\n".join(lines[start:end + 1])
    done = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        raise Missing(f"building the models of {os.path.basename(test_sh)} failed: "
                      f"{done.stderr.strip()[-300:]}")
